#!/usr/bin/env bash
# The GPU device check in one command (docs/gpu.md):
#
#   bash bench/device/run.sh                        # on the device machine: --device cuda, 480 s
#   bash bench/device/run.sh --device cpu --tiny --out /tmp/check   # the CPU dry run (CI runs it)
#
# Options (passed to python -m bench.device.check): --device cuda|cpu, --tiny (tiny shapes, few
# repeats), --budget-s SECONDS (all steps together; default 480), --out DIR (default $OUT),
# --steps a,b,... (a subset). Here only: --no-wheels (do not install the carried wheels).
#
# Carried wheels: when .whl/ (bench/device/fetch_wheels.sh) holds wheels they are installed into a
# target folder first on PYTHONPATH (the device image lacks gRPC health/reflection and pydantic);
# an install that fails is reported and the check goes on with what is installed.
# Writes report.md, report.json and steps.log under the output folder; exit 1 if a step did not
# finish ok (the report says which and why).
set -uo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
args=()
wheels=1
for arg in "$@"; do
  case "$arg" in
    --no-wheels) wheels=0 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exec "$python" -m bench.device.check --help ;;
    *) args+=("$arg") ;;
  esac
done

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
site=${SPECDEC_DEVICE_SITE:-/tmp/specdec-device-site}
if [ "$wheels" = 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "run.sh: installing $(ls .whl/*.whl | wc -l) carried wheels into $site" >&2
  if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/*.whl >&2; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "run.sh: installing the carried wheels failed; going on with the installed packages" >&2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.device.check "${args[@]}"
