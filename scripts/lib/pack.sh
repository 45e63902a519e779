# Sourced by scripts/gpu-round and scripts/conformance-report: the binaries to run.
#
#   use_pack ROOT [PACK]
#
# PACK is the folder or the .tar.xz that scripts/gpu-pack writes (built on another machine);
# without it the binaries are built here into ROOT/build/gpu-round-pack. A relative PACK is
# taken from the current folder. Sets `pack` to the absolute folder holding bin/ and lib/,
# puts lib/ on LD_LIBRARY_PATH, and returns non-zero (with one line on stderr) when PACK is
# missing, cannot be unpacked or holds no bin/flashref.
use_pack() {
  local root=$1 given=${2:-}
  if [[ -z "$given" ]]; then
    pack=$root/build/gpu-round-pack
    "$root/scripts/gpu-pack" "$pack" || return 2
  elif [[ -f "$given" ]]; then  # the compressed pack
    pack=$(mktemp -d)
    tar -xJf "$given" -C "$pack" || { echo "pack: cannot unpack '$given'" >&2; return 2; }
  elif [[ -d "$given" ]]; then
    pack=$given
  else
    echo "pack: expected a folder or a .tar.xz from scripts/gpu-pack, got '$given' (no such path)" >&2
    return 2
  fi
  pack=$(cd "$pack" && pwd)
  if [[ ! -x "$pack/bin/flashref" ]]; then
    echo "pack: expected $pack/bin/flashref, got no such file" >&2
    return 2
  fi
  export LD_LIBRARY_PATH="$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
