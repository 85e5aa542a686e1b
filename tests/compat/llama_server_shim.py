#!/usr/bin/env python3
"""Started by llama.cpp's server test suite in place of llama-server (LLAMA_SERVER_BIN_PATH): its model arguments
(`--hf-repo`, `-m`, `--model-url`, ...), which name downloads this machine cannot make, become `-m $SHIM_MODEL`;
every other argument goes to `$SHIM_TARGET` (`mtpserve serve`) as it is."""

import os
import shlex
import sys

MODEL_FLAGS = {"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu", "--model", "-m"}
DRAFT_FLAGS = {"--hf-repo-draft", "-hfd", "--model-draft", "-md"}


def main() -> None:
    args, kept = sys.argv[1:], []
    i = 0
    while i < len(args):
        if args[i] in MODEL_FLAGS | DRAFT_FLAGS:
            i += 2  # the flag and its value
            continue
        if args[i] != "--offline":
            kept.append(args[i])
        i += 1
    target = shlex.split(os.environ["SHIM_TARGET"])
    os.execvp(target[0], [*target, "-m", os.environ["SHIM_MODEL"], *kept])


if __name__ == "__main__":
    main()
