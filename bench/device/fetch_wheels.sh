#!/usr/bin/env bash
# Download the wheels the device check carries to the GPU machine (bench/device/wheels.txt) into the
# ignored .whl/ folder at the repository root: Python 3.12, manylinux x86-64, --no-deps, one version
# each (pip on the device machine refuses two versions of one package in a single install).
#
#   bash bench/device/fetch_wheels.sh            # fetch what is missing from .whl/
#   bash bench/device/fetch_wheels.sh --sizes    # also rewrite wheels.txt's size column from .whl/
#
# Run it on a machine with network access to the package index; the device machine has none.
# The device call then names `.whl` in its carry list, and bench/device/run.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
list=bench/device/wheels.txt
dest=.whl
mkdir -p "$dest"

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done

wheel_of() {  # the .whl file already downloaded for requirement $1 (name==version), if any
  local name=${1%%==*} version=${1##*==}
  local stem
  stem=$(printf '%s' "$name" | tr 'A-Z-' 'a-z_')
  find "$dest" -maxdepth 1 -iname "${stem}-${version}-*.whl" | head -n 1
}

while read -r requirement _size; do
  case "$requirement" in ''|'#'*) continue ;; esac
  if [ -n "$(wheel_of "$requirement")" ]; then
    continue
  fi
  echo "fetch_wheels: $requirement"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$requirement"
done < "$list"

total=0
while read -r requirement _size; do
  case "$requirement" in ''|'#'*) continue ;; esac
  file=$(wheel_of "$requirement")
  [ -n "$file" ] || { echo "fetch_wheels: no wheel for $requirement in $dest" >&2; exit 1; }
  total=$((total + $(stat -c %s "$file")))
done < "$list"
echo "fetch_wheels: $(ls "$dest"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $dest/"

if [ "${1:-}" = "--sizes" ]; then
  tmp=$(mktemp)
  while IFS= read -r line; do
    read -r requirement _size <<<"$line" || true
    case "$requirement" in
      ''|'#'*) printf '%s\n' "$line" ;;
      *) printf '%s %s\n' "$requirement" "$(stat -c %s "$(wheel_of "$requirement")")" ;;
    esac
  done < "$list" > "$tmp"
  mv "$tmp" "$list"
  echo "fetch_wheels: sizes written to $list"
fi
