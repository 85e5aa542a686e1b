#!/usr/bin/env bash
# The agent clients `make test-agents` runs (tests/agents): the npm packages pinned in tests/agents/package.json
# and its lock file, and openai-agents from tests/agents/requirements.txt, installed into
# ${MTPSERVE_CACHE:-~/.cache/mtpserve}/agents (the Python one under python/, kept apart from the project's venv:
# it brings its own openai). Done once; again only when the pins change. Needs node and npm: Debian's from apt
# when absent.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pins="$repo/tests/agents"
dest="${MTPSERVE_CACHE:-$HOME/.cache/mtpserve}/agents"
py="${PY:-$repo/.venv/bin/python}"
stamp="$dest/.installed-$(cat "$pins/package.json" "$pins/package-lock.json" "$pins/requirements.txt" | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
if ! command -v npm >/dev/null; then
    echo "installing node and npm for the agent clients"
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get update && $sudo apt-get install -y nodejs npm
fi
mkdir -p "$dest"
cp "$pins/package.json" "$pins/package-lock.json" "$dest/"
# npm install, not npm ci: ci refuses a lock without the other platforms' optional packages (npm/cli#4828)
(cd "$dest" && npm install --no-audit --no-fund)
"$py" -m pip install --quiet --no-warn-conflicts --upgrade --target "$dest/python" -r "$pins/requirements.txt"
rm -f "$dest"/.installed-*
touch "$stamp"
