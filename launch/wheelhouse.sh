#!/usr/bin/env bash
# An offline wheelhouse: every wheel that `pip install --no-index --find-links OUT_DIR ntl_pretrain` needs on a
# machine without internet, except torch and what only torch needs (nvidia-*, triton, ...): the cluster keeps the
# torch build that matches its CUDA, installed first. Run it where PyPI is reachable:
#   launch/wheelhouse.sh OUT_DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--torch-version 2.13.0]
#   launch/wheelhouse.sh OUT_DIR --only PINS [--python-version 3.12] [--platform ...]
# Without --python-version / --platform the wheels are for this interpreter and machine ($PYTHON, default python3);
# --platform may be given more than once. --torch-version is the torch the cluster has: dependencies that bound
# torch are resolved against it (default 2.13.0, the tested one). docs/multinode.md, "Air-gapped clusters", lists
# what the wheelhouse holds and its size. --only PINS fetches just the wheels a file of `name==version` lines
# names (no dependencies resolved), DeepSpeed built as below: for a machine that has most of the stack already
# (launch/gpu-wheels.txt, the GPU machine's; docs/doctor.md, "The first GPU").
set -euo pipefail

usage="usage: launch/wheelhouse.sh OUT_DIR [--only PINS] [--python-version X.Y] [--platform TAG]... [--torch-version V]"
fail() { echo "wheelhouse.sh: $1" >&2; exit 2; }
usage_error() { fail "$1"$'\n'"$usage"; }

# pip takes --platform literally: a wheel tagged manylinux2014 (glibc 2.17) does not match manylinux_2_28, although
# it runs there. A manylinux tag is widened to every older glibc, as pip does for the machine it runs on.
platform_tags() {
  local tag=$1 glibc arch
  case $tag in
    manylinux1_*) glibc=5 arch=${tag#manylinux1_} ;;
    manylinux2010_*) glibc=12 arch=${tag#manylinux2010_} ;;
    manylinux2014_*) glibc=17 arch=${tag#manylinux2014_} ;;
    manylinux_2_[0-9]*_*) arch=${tag#manylinux_2_*_} glibc=${tag#manylinux_2_} glibc=${glibc%%_*} ;;
    *) echo "$tag"; return ;;
  esac
  for (( ; glibc >= 5; glibc-- )); do
    echo "manylinux_2_${glibc}_$arch"
    case $glibc in 17) echo "manylinux2014_$arch" ;; 12) echo "manylinux2010_$arch" ;; 5) echo "manylinux1_$arch" ;; esac
  done
}

out_dir="" torch_version="2.13.0" target=() only=""
while (( $# > 0 )); do
  case $1 in
    --python-version|--platform|--torch-version|--only)
      (( $# > 1 )) && [[ $2 != --* ]] || usage_error "$1 needs a value"
      case $1 in
        --torch-version) torch_version=$2 ;;
        --only) only=$2 ;;
        --platform) for tag in $(platform_tags "$2"); do target+=(--platform "$tag"); done ;;
        *) target+=("$1" "$2") ;;
      esac
      shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) usage_error "unknown option $1" ;;
    *) [[ -z $out_dir ]] || usage_error "one OUT_DIR only, got $out_dir and $1"; out_dir=$1; shift ;;
  esac
done
[[ -n $out_dir ]] || usage_error "OUT_DIR missing: the folder to put the wheels in"
[[ ! -e $out_dir || -d $out_dir ]] || fail "$out_dir is a file, not a folder"
# A fresh folder: wheels left from another target or version would be listed and counted as this one's.
[[ ! -d $out_dir || -z $(ls -A "$out_dir") ]] || fail "$out_dir is not empty; give a new or empty folder"

# The pins: `name==version` a line, comments after `#`; checked before anything is fetched.
pins=()
if [[ -n $only ]]; then
  [[ -f $only ]] || fail "--only: $only is not a file"
  while read -r line; do
    line=${line%%#*} line=${line//[[:space:]]/}
    [[ -z $line ]] && continue
    [[ $line =~ ^[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+$ ]] || fail "--only: $only: '$line' is not name==version"
    pins+=("$line")
  done < "$only"
  (( ${#pins[@]} > 0 )) || fail "--only: $only names no wheel"
fi

python=${PYTHON:-python3}
pip=("$python" -m pip --disable-pip-version-check)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

list_wheels() {
  (cd "$out_dir" && stat -c '%s %n' -- *.whl) | sort -k2 | awk '
    { total += $1; printf "%9.1f MB  %s\n", $1 / 1e6, $2 }
    END { printf "%9.1f MB  total, %d wheels\n", total / 1e6, NR }'
}

if [[ -n $only ]]; then
  echo "== the wheels $only pins (no dependencies resolved)"
  others=()
  for pin in "${pins[@]}"; do
    if [[ ${pin%%==*} == deepspeed ]]; then  # an sdist on PyPI: built as below, pure Python
      DS_BUILD_OPS=0 "${pip[@]}" wheel -q --no-deps --wheel-dir "$out_dir" "$pin"
    else
      others+=("$pin")
    fi
  done
  (( ${#others[@]} == 0 )) || "${pip[@]}" download -q --no-deps --only-binary=:all: --dest "$out_dir" \
    ${target[@]+"${target[@]}"} "${others[@]}"
  echo "== $out_dir"
  list_wheels
  exit 0
fi

echo "== ntl_pretrain wheel"
# Built from a copy of what the package is made of: setuptools' build/ folder in the checkout may still hold
# modules deleted since, and would put them in the wheel.
mkdir "$work/src"
tar -C "$repo" --exclude=__pycache__ -cf - pyproject.toml README.md ntl_pretrain | tar -C "$work/src" -xf -
"${pip[@]}" wheel -q --no-deps --wheel-dir "$out_dir" "$work/src"
ntl_wheel=$(ls "$out_dir"/ntl_pretrain-*.whl)

# DeepSpeed ships only an sdist. Built without torch (pip's build isolation, as `pip install deepspeed` builds it)
# and without pre-compiled ops, it is a pure-Python wheel for every Python and platform; its ops are compiled on
# first use on the cluster, exactly as after a plain `pip install deepspeed`.
echo "== deepspeed wheel"
deepspeed_requirement=$("$python" - "$ntl_wheel" <<'EOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(wheel.read(name).decode())
print(next(r for r in metadata.get_all("Requires-Dist") if r.replace(" ", "").startswith("deepspeed")))
EOF
)
DS_BUILD_OPS=0 "${pip[@]}" wheel -q --no-deps --wheel-dir "$out_dir" "$deepspeed_requirement"
deepspeed_wheel=$(ls "$out_dir"/deepspeed-*.whl)
[[ $deepspeed_wheel == *-py3-none-any.whl ]] || fail "$deepspeed_wheel is not a pure-Python wheel"

# A stand-in torch with no dependencies takes torch's place in the resolution: what only torch needs is left out,
# what another package needs too (typing-extensions, filelock, fsspec, ...) is resolved for that package.
stub_version="$torch_version+wheelhouse"
"$python" - "$work/stub" "$stub_version" <<'EOF'
import pathlib, sys, zipfile
folder, version = pathlib.Path(sys.argv[1]), sys.argv[2]
folder.mkdir()
info = f"torch-{version}.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
EOF

echo "== dependencies (without torch)"
# The two wheels are named by path so that a package of the same name on the index cannot replace them.
"${pip[@]}" download -q --dest "$out_dir" --only-binary=:all: --find-links "$out_dir" --find-links "$work/stub" \
  ${target[@]+"${target[@]}"} "$ntl_wheel" "$deepspeed_wheel" "torch==$stub_version"
rm -f "$out_dir"/torch-*+wheelhouse-*.whl

echo "== check: resolved with no index, every requirement (torch aside) has its wheel here"
# `pip download`, not `pip install --dry-run`: install checks Requires-Python against this interpreter, not
# --python-version. Every wheel it resolves is already in the folder, so nothing is copied but the stand-in.
"${pip[@]}" download -q --no-index --dest "$out_dir" --only-binary=:all: --find-links "$out_dir" \
  --find-links "$work/stub" ${target[@]+"${target[@]}"} ntl_pretrain "torch==$stub_version"
rm -f "$out_dir"/torch-*+wheelhouse-*.whl

echo "== $out_dir"
list_wheels
echo "offline install, after torch: pip install --no-index --find-links $out_dir ntl_pretrain"
