#!/usr/bin/env bash
# Regenerates the web page's third-party files in src/mtpserve/server/static/vendor/ (`make webui-assets`).
#
# The page fetches nothing from the internet at run time, so the browser builds of its three libraries are
# committed to the repository; this script is the only way they are made. It `npm pack`s the pinned versions
# below (the tarballs checked against the pinned npm integrity hashes), copies each library's ready-made browser
# build and its license files unchanged, and writes vendor/VERSIONS.txt. To update a library: change its version
# and integrity (`npm view PACKAGE@VERSION dist.integrity`), run `make webui-assets`, run tests/server/test_webui.py,
# and update the table in docs/serving.md ("The web page").
#
# Needs node/npm and the npm registry; CI and users never run it (they use the committed files).
set -euo pipefail

# package, version, integrity, then "source-in-package:destination-file" pairs
MARKED=(marked 18.2.1
    sha512-ii4bxCTCqqwpT86XZWgJNs+ZnAIZksmLGYMViWA7PDIXYIeNo1x6cDdX3JOip9NM/cI6p8z57FxliACboTruMA==
    lib/marked.umd.js:marked.umd.js
    LICENSE:marked.LICENSE.txt)
DOMPURIFY=(dompurify 3.5.0
    sha512-LYC0ZkE8P1V42JsRYTwMdme/2ET8SpOc5AA2eOFjP/IadvRd2fwiT4TVz5vkfy0XUx12aS2UaRkTnfVPNOv9vw==
    dist/purify.min.js:purify.min.js
    LICENSE:dompurify.LICENSE.txt
    LICENSE-MPL:dompurify.LICENSE-MPL.txt)
HIGHLIGHT=(@highlightjs/cdn-assets 11.12.0
    sha512-KvOKXODaiFmId9xaq3xc5xCL66wVLUuOngDbO9B/kewbFTqdGbn2nJxNhN3H5R1cgDTVj6R8vH0zgiNDEGjpDw==
    highlight.min.js:highlight.min.js
    styles/github.min.css:highlight-github.min.css
    styles/github-dark.min.css:highlight-github-dark.min.css
    LICENSE:highlight.js.LICENSE.txt)

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/src/mtpserve/server/static/vendor"
command -v npm >/dev/null || { echo "vendor_webui.sh: npm is needed (apt-get install npm, or nodejs.org)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

staged="$work/vendor"
mkdir -p "$staged"
versions="$staged/VERSIONS.txt"
{
    echo "# Written by tools/vendor_webui.sh: the npm packages the files here come from, copied unchanged."
    echo "# package version integrity(npm tarball)"
} >"$versions"

vendor() {
    local name=$1 version=$2 integrity=$3
    shift 3
    local dir="$work/$(echo "$name" | tr -d @ | tr / -)"
    mkdir -p "$dir"
    (cd "$dir" && npm pack --silent "$name@$version" >tarball.txt)
    local tarball="$dir/$(tail -n 1 "$dir/tarball.txt")"
    local actual="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w 0)"
    if [ "$actual" != "$integrity" ]; then
        echo "vendor_webui.sh: $name@$version: integrity $actual, expected $integrity" >&2
        exit 1
    fi
    tar -xzf "$tarball" -C "$dir"
    for pair in "$@"; do
        cp "$dir/package/${pair%%:*}" "$staged/${pair#*:}"
    done
    echo "$name $version $integrity" >>"$versions"
}

vendor "${MARKED[@]}"
vendor "${DOMPURIFY[@]}"
vendor "${HIGHLIGHT[@]}"

{
    echo "# sha256 of each file"
    (cd "$staged" && sha256sum -- *.js *.css *.txt | grep -v ' VERSIONS.txt$')
} >>"$versions"

rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
cp -r "$staged" "$dest"
echo "vendor_webui.sh: wrote $(ls "$dest" | wc -l) files to ${dest#"$root"/}"
