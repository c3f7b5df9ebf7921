// Which instruction set's kernels run (the best this CPU supports, or one named), and how a
// count of work items splits over threads. Plain C++ (no Python), so that the standalone ISA
// check (tests/kernels/int4_isa_check.cpp) links it as the extension does.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "attention.h"

namespace tandem {

constexpr int kMaxThreads = 1024;

// Compiled in and runnable on this CPU, best first.
std::vector<const KernelTable*> usable_kernels();

// The table named `isa`, or the best usable one for ""; std::invalid_argument naming the usable
// ones otherwise.
const KernelTable& select_kernels(const std::string& isa);

// [0, count) split into `parts` contiguous ranges; the range of `part`.
std::pair<int, int> split_range(int count, int parts, int part);

}  // namespace tandem
