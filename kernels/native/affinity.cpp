// Pins the calling thread's OpenMP team one thread to a core (engines/builtin/cpu_affinity.py): thread i of
// a team of n on cores[i]. torch's parallel regions and these kernels' share one libgomp per process, and
// libgomp keeps a master thread's workers between regions, so the pins hold from step to step; where it
// ends and re-creates workers (a smaller team asked for by a library, then a full one), the new ones come
// unpinned, so the engine calls this before every step: each thread remembers its core, and a call that
// finds every thread where it belongs costs one parallel region and no system call.

#include <cstdint>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" {

// 0 when every thread is pinned; -1 when a pin failed; -2 where this platform cannot pin; -3 when the team
// came out smaller than num_cores (OMP_DYNAMIC or a thread limit): the cores past it get no thread.
int parrot_pin_threads(const int32_t *cores, int num_cores) {
#if defined(__linux__) && defined(_OPENMP)
    int failures = 0, team = 0;
#pragma omp parallel num_threads(num_cores) reduction(+ : failures)
    {
        thread_local int32_t pinned_to = -1;
        const int32_t core = cores[omp_get_thread_num()];
        if (pinned_to != core) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(core, &set);
            if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0)
                pinned_to = core;
            else
                failures++;
        }
#pragma omp single nowait
        team = omp_get_num_threads();
    }
    if (failures) return -1;
    return team == num_cores ? 0 : -3;
#else
    (void)cores, (void)num_cores;
    return -2;
#endif
}

}  // extern "C"
