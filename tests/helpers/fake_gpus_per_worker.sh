#!/usr/bin/env bash
# Fake GPU discovery for a local-cluster of two workers on one machine (no GPU on CI): the first
# worker to ask gets GPUs 0 and 1, the next 2 and 3, as one 4-GPU host with two executors. The
# test session runs a copy of this script from an empty directory of its own, where the first
# worker leaves its mark.
here="$(cd "$(dirname "$0")" && pwd)"
if mkdir "$here/worker-0" 2>/dev/null; then
  echo '{"name": "gpu", "addresses": ["0", "1"]}'
else
  echo '{"name": "gpu", "addresses": ["2", "3"]}'
fi
