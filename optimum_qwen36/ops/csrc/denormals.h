// Denormal floats are flushed to zero inside the native kernels' worker loops.
//
// The gated delta rule multiplies by decays e^(c_i - c_j) that underflow under strong gates, and softmax
// weights far below the row maximum do too: their products land in the denormal range, where Intel cores
// take a microcode assist per operation (a prefill ran 2-3x slower on a Xeon than with them flushed). A
// denormal is below 1.2e-38, far under every tolerance the kernels are held to.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace optimum_qwen36 {

// Sets flush-to-zero and denormals-are-zero on this thread for the guard's lifetime (MXCSR is per thread:
// each worker of a parallel loop takes its own guard), then restores the caller's mode.
class FlushDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  unsigned saved_;
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace optimum_qwen36
