#!/usr/bin/env bash
# Fake GPU discovery for Spark (no GPU on CI): prints two addresses.
echo '{"name": "gpu", "addresses": ["0", "1"]}'
