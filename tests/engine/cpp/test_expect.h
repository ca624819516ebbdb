// The EXPECT macro and failure count shared by the C++ unit tests (no test framework: the engine tests build
// against torch alone).
#pragma once

#include <cstdio>

namespace hsoffload_test {
inline int failures = 0;
}  // namespace hsoffload_test

#define EXPECT(cond)                                                                     \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: EXPECT failed: %s\n", __FILE__, __LINE__, #cond);     \
      ++hsoffload_test::failures;                                                        \
    }                                                                                    \
  } while (0)

// Ends main(): prints the verdict and returns the exit code.
#define EXPECT_DONE(name)                                                                \
  do {                                                                                   \
    if (hsoffload_test::failures) {                                                      \
      std::fprintf(stderr, "%d expectation(s) failed\n", hsoffload_test::failures);      \
      return 1;                                                                          \
    }                                                                                    \
    std::printf(name ": all passed\n");                                                  \
    return 0;                                                                            \
  } while (0)
