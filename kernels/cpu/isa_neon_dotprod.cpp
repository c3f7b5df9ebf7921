// NEON with the armv8.2-a dot product extension: isa_neon.cpp compiled again with
// -march=armv8.2-a+dotprod, so the int8-activation INT4 matmul multiplies by sdot (Q8Dot there);
// the rest is the neon path's code. Called only where the CPU reports asimddp (bindings' dispatch).
#if defined(__ARM_FEATURE_DOTPROD)
#define TANDEM_NEON_NAME "neon_dotprod"
#define TANDEM_NEON_TABLE neon_dotprod_kernels
#include "isa_neon.cpp"
#else
#include "attention.h"
namespace tandem {
const KernelTable* neon_dotprod_kernels() { return nullptr; }
}  // namespace tandem
#endif
