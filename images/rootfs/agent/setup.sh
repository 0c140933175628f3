#!/usr/bin/env bash
# Runs inside the `agent` image's tree (chroot) after its packages: what
# the npm registry and PyPI provide.
set -euo pipefail
# Debian names fd `fdfind`; agents call it `fd`.
ln -sf /usr/bin/fdfind /usr/local/bin/fd
# Node.js LTS from the npm registry (Debian's is 18): /usr/local/bin/node
# comes before /usr/bin/node on PATH.
npm install --global --no-fund --no-audit node@22
hash -r
node --version
# The coding agents' CLIs, on PATH in /usr/local/bin.
npm install --global --no-fund --no-audit @anthropic-ai/claude-code @openai/codex
claude --version
codex --version
# uv, from PyPI, for Python projects (Debian's pip refuses system installs
# without the flag; this image is the system's to shape).
python3 -m pip install --break-system-packages uv
uv --version
# npm's and pip's caches are the build's (extend.sh keeps them out of the image).
