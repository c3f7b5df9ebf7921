// AVX-512 with VNNI: isa_avx512.cpp compiled again with -mavx512vnni, so the INT4 matmul's dot
// product fuses its multiply and add (vpdpwssd, Dot there); the rest is the avx512 path's code.
#if defined(__AVX512VNNI__)
#define TANDEM_AVX512_NAME "avx512_vnni"
#define TANDEM_AVX512_TABLE avx512_vnni_kernels
#include "isa_avx512.cpp"
#else
#include "attention.h"
namespace tandem {
const KernelTable* avx512_vnni_kernels() { return nullptr; }
}  // namespace tandem
#endif
