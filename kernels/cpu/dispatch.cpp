#include "dispatch.h"

#include <cstdint>
#include <stdexcept>

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace tandem {
namespace {

bool cpu_supports(const std::string& isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (isa == "avx512_vnni") return cpu_supports("avx512") && __builtin_cpu_supports("avx512vnni");
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
#if defined(__aarch64__) && defined(__linux__)
  if (isa == "neon_dotprod") return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
  return isa == "neon" || isa == "scalar";  // neon is compiled only where it is baseline
}

}  // namespace

std::vector<const KernelTable*> usable_kernels() {
  std::vector<const KernelTable*> usable;
  for (const KernelTable* table : {avx512_vnni_kernels(), avx512_kernels(), avx2_kernels(), neon_dotprod_kernels(),
                                   neon_kernels(), scalar_kernels()}) {
    if (table != nullptr && cpu_supports(table->name)) usable.push_back(table);
  }
  return usable;
}

const KernelTable& select_kernels(const std::string& isa) {
  static const std::vector<const KernelTable*> usable = usable_kernels();
  if (isa.empty()) return *usable.front();
  std::string names;
  for (const KernelTable* table : usable) {
    if (isa == table->name) return *table;
    names += names.empty() ? table->name : std::string(", ") + table->name;
  }
  throw std::invalid_argument("isa '" + isa + "' is not usable on this CPU/build; usable: " + names);
}

std::pair<int, int> split_range(int count, int parts, int part) {
  return {static_cast<int>(static_cast<int64_t>(count) * part / parts),
          static_cast<int>(static_cast<int64_t>(count) * (part + 1) / parts)};
}

}  // namespace tandem
