# Sourced by the device scripts whose tests or daemons need etcd (the device has none):
# Debian's /usr/bin/etcd travels xz-compressed in the carried binaries ($BIN/etcd.xz, 6.6 of
# 21.5 MB; pack it with `xz -1 -c /usr/bin/etcd > .devbin/etcd.xz`) and is unpacked onto
# PATH here (xz, else Python's lzma). Nothing happens where etcd is on PATH already.
if ! command -v etcd > /dev/null && [[ -f $BIN/etcd.xz ]]; then
  mkdir -p /tmp/kvcd-etcd-bin
  xz -dc "$BIN/etcd.xz" > /tmp/kvcd-etcd-bin/etcd 2> /dev/null ||
    python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' \
      "$BIN/etcd.xz" > /tmp/kvcd-etcd-bin/etcd
  chmod +x /tmp/kvcd-etcd-bin/etcd
  export PATH=/tmp/kvcd-etcd-bin:$PATH
fi
