// Shared by the streaming linear kernels: turn a runtime row count (1..8) into a compile-time constant,
// so each kernel's per-row accumulators live in registers.
#pragma once

#include <cstdint>
#include <type_traits>

template <typename Fn>
inline void dispatch_m(int64_t M, Fn&& fn) {
  switch (M) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}
