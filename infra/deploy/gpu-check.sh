#!/usr/bin/env bash
# The GPU checks of docs/decoding.md in one run: at most about 8 minutes on one GPU.
#
#   infra/deploy/gpu-check.sh wheels        # here (pip reaches PyPI): genrec's needs that a
#                                           # CUDA image with torch + transformers lacks -> .whl/
#   infra/deploy/gpu-check.sh run [OUT]     # on the GPU machine, from the repository root
#
# `run` uses that machine's python3 (its torch, transformers, numpy, scipy, tqdm,
# matplotlib) and installs .whl/ into /tmp/site when the folder is there. It writes
# JSON, PNG and logs under OUT (default $OUT, else var/gpu-check):
#   1. the batched engine by batch size (random models of the `small` shape, K = 10):
#      float32 eager, bfloat16 eager, bfloat16 + torch.compile reduce-overhead (CUDA graphs);
#   2. `genrec bench decode --random` (HF generate vs target-only vs strict vs relaxed)
#      in float32 and bfloat16;
#   3. `genrec bench load` against the store in GPU_CHECK_HOME when that is set and a JDK
#      is there (the local Kafka broker needs one), otherwise a line saying why it skipped.
# Each step has its own time limit, so one that hangs costs its limit, not the run.
set -uo pipefail

PY=${PYTHON:-python3}
WHEELS=(kafka-python confluent-kafka crc32c sqlalchemy greenlet pydantic pydantic-core annotated-types
        typing-inspection pydantic-settings python-dotenv)

download_wheels() {
    mkdir -p .whl
    for name in "${WHEELS[@]}"; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
            --platform manylinux1_x86_64 -d .whl "$name" || exit 1
    done
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    du -sh .whl
}

step() {  # step SECONDS NAME COMMAND...: run one check with a time limit, log to OUT/NAME.log
    local limit=$1 name=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s (log $OUT/$name.log)"
    [ $rc -eq 0 ] || tail -5 "$OUT/$name.log"
}

run_checks() {
    OUT=${1:-${OUT:-var/gpu-check}}
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
    if [ -d .whl ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # genrec's folders install as genrec.<folder> (pyproject.toml): the same, by links
    local src=/tmp/genrec-src/genrec
    mkdir -p "$src"
    for folder in schemas infra ingest online offline app; do ln -sfn "$PWD/$folder" "$src/$folder"; done
    export PYTHONPATH=/tmp/genrec-src${PYTHONPATH:+:$PYTHONPATH} GENREC_HOME=$OUT/home TQDM_MININTERVAL=5
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda:",
        torch.cuda.get_device_name() if torch.cuda.is_available() else "none")' | tee "$OUT/device.txt"

    local users=${GPU_CHECK_USERS:-64}  # fewer for a dry run on a CPU
    local engine="$PY -m genrec.app.bench.engine --batch-sizes 1,8,32,64 --k 10 --users $users"
    step 80 engine-float32 $engine --dtype float32 --json "$OUT/engine-float32.json"
    step 80 engine-bfloat16 $engine --dtype bfloat16 --json "$OUT/engine-bfloat16.json"
    step 120 engine-bfloat16-graphs $engine --dtype bfloat16 --compile reduce-overhead \
        --json "$OUT/engine-bfloat16-graphs.json"
    local decode="$PY -m genrec.app.cli bench decode --random --ks 1,10,20 --batch-sizes 1,64"
    step 110 decode-float32 $decode --users "$users" --dtype float32 \
        --json "$OUT/decode-float32.json"
    step 110 decode-bfloat16 $decode --users "$users" --dtype bfloat16 \
        --json "$OUT/decode-bfloat16.json"
    if ! command -v java > /dev/null; then
        echo "load: skipped, no JDK on this machine (the local Kafka broker needs java)" \
            | tee "$OUT/load.log"
    elif [ -z "${GPU_CHECK_HOME:-}" ]; then
        echo "load: skipped, no store: set GPU_CHECK_HOME to a genrec home with an active" \
            "serving version (e.g. the one make demo builds)" | tee "$OUT/load.log"
    else
        step 200 load env GENREC_HOME="$GPU_CHECK_HOME" "$PY" -m genrec.app.cli bench load \
            --workers 1 --step-s 15 --json "$OUT/load.json"
    fi
    "$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("engine-*.json")):
    report = json.loads(path.read_text())
    cells = [f"b{r['batch_size']}: " + "/".join(f"{r[m]['ms_per_request']:.2f}"
             for m in ("target", "strict", "relaxed") if m in r) for r in report["rows"]]
    print(path.stem, report["runtime"], "ms/request target/strict/relaxed", "; ".join(cells))
for path in sorted(out.glob("decode-*.json")):
    report = json.loads(path.read_text())
    print(path.stem, report["runtime"], "speedup", report["speedup"], "lossless", report["lossless"])
EOF
}

case ${1:-} in
    wheels) download_wheels ;;
    run) shift; run_checks "$@" ;;
    *) echo "usage: $0 wheels | run [OUT]" >&2; exit 2 ;;
esac
