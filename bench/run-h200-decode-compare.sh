export LD_LIBRARY_PATH=$PWD/.devlibs NCCL_NVLS_ENABLE=0
nvidia-cuda-mps-control -d && echo "MPS on"
source scripts/daemon-lib.sh
for bin in kvcd kvcd-before kvcd; do
  start_kvcd .devbin/$bin deploy/config/kvcd-dataplane.yaml || continue
  echo "===== $bin"
  .devbin/kvcd_prefill_worker --target $KVCD_GRPC --model qwen3-8b-int2 --tokens 32768 --salt p --repeat 1 | grep -E '^push'
  .devbin/kvcd_decode_worker --target $KVCD_GRPC --model qwen3-8b-int2 --tokens 32768 --salt p --steps 32 2>&1 | grep -E 'tokens/s|per call'
  .devbin/kvcd_decode_worker --target $KVCD_GRPC --model qwen3-8b-int2 --tokens 32768 --salt p --steps 4 --sync 2>&1 | grep -E 'tokens/s|per call'
  stop_kvcd
done
echo quit | nvidia-cuda-mps-control
./scripts/test-python-device.sh > $OUT/python.log 2>&1; echo "python rc $?"; tail -12 $OUT/python.log
