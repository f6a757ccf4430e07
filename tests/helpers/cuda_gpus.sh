#!/usr/bin/env bash
# GPU discovery for Spark from what torch sees (tests/gpu): {"name": "gpu", "addresses": ["0", ...]}.
exec "${PYSPARK_PYTHON:-python3}" -c 'import json, torch; print(json.dumps({"name": "gpu", "addresses": [str(i) for i in range(torch.cuda.device_count())]}))'
