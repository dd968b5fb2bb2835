#!/usr/bin/env bash
# Install Mooncake's CPU build into the current Python and the Debian libraries its store client
# and master link (libibverbs1, libnl-3-200, libnl-route-3-200) into .mooncake/lib, each pinned by
# hash. No root: the packages are fetched with `apt-get download` and unpacked with `dpkg -x`.
# sgl_kvmap.sglang.mooncake loads the libraries from there (KVMAP_MOONCAKE_LIBS overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q --no-deps --require-hashes -r /dev/stdin <<'PINS'
mooncake-transfer-engine-non-cuda==0.3.13.post1 --hash=sha256:ca9f668a04ffe648b250fda28b97d0a7da149cb110dec5cf3d166a9e68afc940
PINS
debs=.mooncake/debs
mkdir -p "$debs" .mooncake/lib
(cd "$debs" && apt-get download -q libibverbs1=44.0-2 libnl-3-200=3.7.0-0.2+b1 \
  libnl-route-3-200=3.7.0-0.2+b1 2>/dev/null && sha256sum -c --quiet <<'SUMS')
35054815259fee46173240254246d03b673a5cd5c528aaac96fd15ac428a8d59  libibverbs1_44.0-2_amd64.deb
d1fc3e9eb8e79b4c96b0a64c3d8c9e068ae2f665cab71bd19f417ffd0453a890  libnl-3-200_3.7.0-0.2+b1_amd64.deb
0fdcc425ae2982788c085c76a7cb0eda3e3db99d41bd1ce56082ee18e9f1e21f  libnl-route-3-200_3.7.0-0.2+b1_amd64.deb
SUMS
rm -rf .mooncake/unpacked
for deb in "$debs"/*.deb; do dpkg -x "$deb" .mooncake/unpacked; done
find .mooncake/unpacked -name '*.so*' -exec cp -P {} .mooncake/lib/ \;
rm -rf .mooncake/unpacked
LD_LIBRARY_PATH="$PWD/.mooncake/lib" python -c "from mooncake.store import MooncakeDistributedStore"
echo "Mooncake ready (libraries in .mooncake/lib)"
