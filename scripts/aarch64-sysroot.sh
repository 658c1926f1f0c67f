#!/usr/bin/env bash
# Prepare aarch64 Linux under qemu-user for `make portability` (idempotent; everything under $1):
#   $1/sysroot  arm64 Debian python3.11 and its libraries, unpacked with dpkg -x (no multiarch install)
#   $1/site     aarch64 manylinux wheels from PyPI of detinfer's dependencies, at this venv's versions, unzipped
# Needs root for apt-get (qemu-user-static, and arm64 as a foreign architecture to download its packages).
# Run:  qemu-aarch64-static -L $1/sysroot $1/sysroot/usr/bin/python3.11   with PYTHONPATH=CHECKOUT:$1/site
set -euo pipefail
OUT=$(realpath -m "$1")
VENV_PY=${VENV_PY:-.venv/bin/python}
mkdir -p "$OUT"
if [ ! -x /usr/bin/qemu-aarch64-static ] || ! dpkg --print-foreign-architectures | grep -qx arm64; then
    dpkg --add-architecture arm64
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null
fi
if [ ! -x "$OUT/sysroot/usr/bin/python3.11" ]; then
    mkdir -p "$OUT/debs" "$OUT/sysroot"
    (cd "$OUT/debs" && apt-get download -qq $(printf '%s:arm64 ' \
        python3.11 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libexpat1 zlib1g libssl3 \
        libffi8 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libgcc-s1 libstdc++6 \
        libcrypt1 libdb5.3 libgdbm6 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 \
        libcom-err2 libkeyutils1))
    for d in "$OUT"/debs/*.deb; do dpkg -x "$d" "$OUT/sysroot"; done
fi
if [ ! -f "$OUT/site/.complete" ]; then
    # detinfer's runtime dependencies at the versions this checkout's venv runs (pip resolves theirs for aarch64)
    REQS=$("$VENV_PY" - <<'PY'
import importlib.metadata as md, re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
names = [re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] for d in deps]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
PY
)
    rm -rf "$OUT/wheels" "$OUT/site"
    aarch64_wheels() {
        "$VENV_PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
            --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
            -d "$OUT/wheels" "$@"
    }
    for req in $REQS; do
        # a package with no aarch64 wheel at the venv's version (llguidance 1.9.1) takes its newest aarch64 wheel:
        # it is not on the numerical path, and versions are informative, never compared
        aarch64_wheels "$req" 2>/dev/null || { echo "no aarch64 wheel of $req; using the newest one"; aarch64_wheels "${req%%==*}"; }
    done
    mkdir -p "$OUT/site"
    for w in "$OUT"/wheels/*.whl; do "$VENV_PY" -m zipfile -e "$w" "$OUT/site"; done
    touch "$OUT/site/.complete"
fi
qemu-aarch64-static -L "$OUT/sysroot" "$OUT/sysroot/usr/bin/python3.11" -c 'import platform; print("aarch64 sysroot ready:", platform.machine(), platform.python_version())'
