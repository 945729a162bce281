#!/bin/bash
# ncu of a kernel of the MLA decode at B=1 (stall reasons per SASS line; KERNEL: a name regex, default
# the attention; SIZES: contexts): bash benchmarks/ncu_mla.sh
export PYTHONPATH=$PWD
NCU=${NCU:-/usr/local/cuda/bin/ncu}
for S in ${SIZES:-4096 32768}; do
  $NCU -k regex:${KERNEL:-_mla_attn} --launch-skip 4 --launch-count 1 --set full --import-source yes -f \
    -o $OUT/attn_$S python3 benchmarks/ncu_mla_drive.py 1 $S > $OUT/ncu_$S.log 2>&1 || tail -5 $OUT/ncu_$S.log
  $NCU --import $OUT/attn_$S.ncu-rep --page details --print-details all > $OUT/details_$S.txt 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Ipc|Memory Throughput|DRAM Throughput|Dynamic Shared|Block Limit|L2 Hit|No Eligible|Active Warps Per|Mem Busy|Max Bandwidth|Mem Pipes Busy|SM Busy|Issue Slots Busy|Shared Memory|Bank" $OUT/details_$S.txt | head -45
  $NCU --import $OUT/attn_$S.ncu-rep --page source --csv --print-source sass > $OUT/src_$S.csv 2>&1
  python3 benchmarks/ncu_summary.py $OUT/src_$S.csv 45; gzip -f $OUT/src_$S.csv; rm -f $OUT/attn_$S.ncu-rep
done
