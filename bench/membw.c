/* Memory read bandwidth of this machine, for the engine figures in bench/RESULTS.md: the best of
 * five passes summing a buffer of MB mebibytes (256-bit loads), with one and with two threads.
 * A decode step reads every weight once (SmolLM2 Q4_1: about 98 MB), so tokens/s x 98 MB over
 * this figure is how close an engine comes to the memory limit.
 *
 *   gcc -O2 -mavx2 -fopenmp bench/membw.c -o /tmp/membw && /tmp/membw 96
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  size_t mb = argc > 1 ? (size_t)atoi(argv[1]) : 96, n = mb << 20;
  char *a = aligned_alloc(64, n);
  if (!a) return 1;
  memset(a, 1, n);
  for (int th = 1; th <= 2; th++) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
      double t = now();
      __m256i tot = _mm256_setzero_si256();
#pragma omp parallel num_threads(th)
      {
        __m256i acc = _mm256_setzero_si256();
#pragma omp for
        for (size_t i = 0; i < n; i += 128) {
          acc = _mm256_add_epi8(acc, _mm256_load_si256((__m256i *)(a + i)));
          acc = _mm256_add_epi8(acc, _mm256_load_si256((__m256i *)(a + i + 32)));
          acc = _mm256_add_epi8(acc, _mm256_load_si256((__m256i *)(a + i + 64)));
          acc = _mm256_add_epi8(acc, _mm256_load_si256((__m256i *)(a + i + 96)));
        }
#pragma omp critical
        tot = _mm256_add_epi8(tot, acc);
      }
      double gb = n / (now() - t) / 1e9;
      if (gb > best) best = gb;
      volatile int keep = _mm256_extract_epi8(tot, 0);
      (void)keep;
    }
    printf("%zu MB, %d thread%s: %.1f GB/s\n", mb, th, th > 1 ? "s" : "", best);
  }
  free(a);
  return 0;
}
