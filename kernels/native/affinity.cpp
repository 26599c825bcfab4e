// Pins the calling thread's OpenMP team one thread to a core (engines/builtin/cpu_affinity.py): thread i of
// a team of n on cores[i]. libgomp keeps a master thread's workers between parallel regions of the same
// size, and torch's regions and these kernels' share them (one libgomp per process), so the pins hold for
// every later step.

#include <cstdint>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" {

// 0 when every thread was pinned; -1 where this platform cannot (the caller says so once).
int parrot_pin_threads(const int32_t *cores, int num_cores) {
#if defined(__linux__) && defined(_OPENMP)
    int failures = 0;
#pragma omp parallel num_threads(num_cores) reduction(+ : failures)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cores[omp_get_thread_num()], &set);
        failures += pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0;
    }
    return failures ? -1 : 0;
#else
    (void)cores, (void)num_cores;
    return -1;
#endif
}

}  // extern "C"
