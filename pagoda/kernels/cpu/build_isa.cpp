// The instruction sets this build was compiled for, as the preprocessor saw them (its -march): Python asks
// the loaded build which vector paths it has (kernels/cpu_extension.py: BuildIsa), not the CPU, because an
// x86-64-v3 build running on an AVX-512 CPU has none of its AVX-512 paths. Names as /proc/cpuinfo spells them.

#include <torch/library.h>

#include <string>

namespace {

std::string build_isa() {
  std::string s;
  auto add = [&s](const char* name) { s += s.empty() ? name : std::string(" ") + name; };
#if defined(__AVX2__)
  add("avx2");
#endif
#if defined(__FMA__)
  add("fma");
#endif
#if defined(__F16C__)
  add("f16c");
#endif
#if defined(__AVX512F__)
  add("avx512f");
#endif
#if defined(__AVX512BW__)
  add("avx512bw");
#endif
#if defined(__AVX512VL__)
  add("avx512vl");
#endif
#if defined(__AVX512BF16__)
  add("avx512_bf16");
#endif
#if defined(__AVX512VNNI__)
  add("avx512_vnni");
#endif
#if defined(__GFNI__)
  add("gfni");
#endif
#if defined(__ARM_NEON)
  add("asimd");
#endif
#if defined(__ARM_FEATURE_DOTPROD)
  add("asimddp");  // sdot: the INT4 x INT8-activation kernel
#endif
#if defined(__ARM_FEATURE_SVE)
  add("sve");
#endif
  (void)add;
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) { m.def("build_isa() -> str", &build_isa); }  // no tensors: no dispatch key
