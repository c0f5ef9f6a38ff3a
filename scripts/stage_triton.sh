#!/usr/bin/env bash
# Stage another Triton release for the GPU machine (whose image has torch 2.11 + triton 3.6 and no network), to
# run our kernels on it: `bash scripts/stage_triton.sh 3.9.0 build/t39` downloads the CPython 3.12 wheel, drops
# what a sm_90 compile does not need (the AMD backend, CUPTI, proton, the instrumentation library; from 3.9 the older
# ptxas becomes a link to "ptxas-blackwell", the one 3.9 compiles sm_90 with), and splits the xz tarball
# into DIR/a and DIR/b, each small enough for one device call's carry (64 MiB with the working tree).
#   call 1 (carry DIR/a):  mkdir -p $HOME/tstage && cp DIR/a/part.* $HOME/tstage/
#   call 2 (carry DIR/b), on the same warm machine:
#     mkdir -p $HOME/tsite && cat $HOME/tstage/part.* DIR/b/part.* | xz -d | (cd $HOME/tsite && tar xf -)
#   then PYTHONPATH=$HOME/tsite:<a tree whose support.GLUON_TRITON lists the release> for the runs.
set -euo pipefail
version=${1:?usage: stage_triton.sh VERSION DIR}
dir=${2:?usage: stage_triton.sh VERSION DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  "triton==$version" -d "$tmp/whl"
mkdir -p "$tmp/site" && (cd "$tmp/site" && python3 -m zipfile -e "$tmp"/whl/*.whl .)
t="$tmp/site/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
  "$t/_C/libproton.so" "$t/instrumentation"
sed -i '/amd/d' "$tmp"/site/triton-*.dist-info/entry_points.txt
minor=$(echo "$version" | cut -d. -f2)
if [ "${version%%.*}" -gt 3 ] || [ "$minor" -ge 9 ]; then  # (before 3.9 the older ptxas compiles sm_90: keep it)
  rm -f "$t/backends/nvidia/bin/ptxas" && ln -s ptxas-blackwell "$t/backends/nvidia/bin/ptxas"
fi
chmod +x "$t"/backends/nvidia/bin/*
mkdir -p "$dir/a" "$dir/b"
(cd "$tmp/site" && tar cf - .) | xz -T0 -6 > "$tmp/site.tar.xz"
size=$(stat -c %s "$tmp/site.tar.xz")
(cd "$dir/a" && split -b $(( size / 2 + 1 )) "$tmp/site.tar.xz" part.)
mv "$dir/a/part.ab" "$dir/b/"
for part in "$dir"/a/part.aa "$dir"/b/part.ab; do  # each with the working tree (~9 MB) within a call's 64 MiB
  if [ "$(stat -c %s "$part")" -gt 55000000 ]; then
    echo "stage_triton.sh: $part is over 55 MB: too large for one device call's carry" >&2
    exit 1
  fi
done
du -sh "$dir/a" "$dir/b"
