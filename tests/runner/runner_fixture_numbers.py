"""What the kernel-trace fixture files encode (see fixtures/regenerate.py), for the assertions."""

# Every kernel-trace fixture holds 4 steps of: a bf16 GEMM (100 us), an RCCL kernel (30 us,
# overlapping the GEMM by 10 us), CK flash attention (50 us), 3 elementwise kernels (5 us each),
# an fp32 GEMM (20 us). Per step: 215 us of kernel time, 205 us busy.
STEPS = 4
KERNEL_NS_PER_STEP = 215_000
BUSY_NS_PER_STEP = 205_000
GEMM_SHARE = 400_000 / 860_000 * 100
