/* The int8 multiply-add peak of this CPU's VNNI units: 12 independent accumulators of vpdpbusd
 * (u8 x s8 -> s32, 4 products a lane), nothing else in the loop, one loop per thread.
 *
 *   gcc -O2 -march=native -pthread bench/results/zen4-2026-12-06b/vnni_peak.c -o /tmp/vnni_peak
 *   /tmp/vnni_peak THREADS WIDE   (WIDE 1: 512-bit zmm, 0: 256-bit ymm)
 *
 * Ops are counted as GEMMs count them, 2 a multiply-add, so the figure compares with a GEMM's GOPS.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define ACC 12
static long ITERS=200000000/ACC;
/* One thread's loop at one vector width: ACC chains of vpdpbusd, then every lane of every chain summed
 * (so the compiler keeps all the work). VEC: the vector type, DP: its dpbusd, SET8 / SET32: its
 * broadcasts. */
#define VNNI_LOOP(NAME, VEC, DP, SET8, SET32)                                   \
  static void *NAME(void *arg) {                                                \
    VEC a = SET8(1), b = SET8(2), acc[ACC];                                     \
    for (int i = 0; i < ACC; i++) acc[i] = SET32(i);                            \
    for (long n = 0; n < ITERS; n++) {                                          \
      _Pragma("GCC unroll 12")                                                  \
      for (int i = 0; i < ACC; i++) acc[i] = DP(acc[i], a, b);                  \
      __asm__ volatile("" : "+v"(a));                                           \
    }                                                                           \
    int r = 0, lanes[sizeof(VEC) / 4];                                          \
    for (int i = 0; i < ACC; i++) {                                             \
      memcpy(lanes, &acc[i], sizeof lanes);                                     \
      for (unsigned j = 0; j < sizeof(VEC) / 4; j++) r += lanes[j];             \
    }                                                                           \
    *(int *)arg = r;                                                            \
    return NULL;                                                                \
  }
VNNI_LOOP(work, __m512i, _mm512_dpbusd_epi32, _mm512_set1_epi8, _mm512_set1_epi32)
VNNI_LOOP(work256, __m256i, _mm256_dpbusd_epi32, _mm256_set1_epi8, _mm256_set1_epi32)

int main(int argc,char**argv){
  int threads=atoi(argv[1]); int wide=atoi(argv[2]);
  pthread_t t[8]; int out[8];
  double t0=now();
  for(int i=0;i<threads;i++) pthread_create(&t[i],0,wide?work:work256,&out[i]);
  for(int i=0;i<threads;i++) pthread_join(t[i],0);
  double dt=now()-t0;
  double macs=(double)ITERS*ACC*(wide?64:32)*threads;
  printf("%d threads, %s: %.0f GOPS (2 ops a MAC)\n",threads,wide?"zmm":"ymm",2*macs/dt/1e9);
  return out[0]==42;
}
