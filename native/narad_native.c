/*
 * narad native helpers: lock-free access to the shared-memory version
 * counter array and a parent-death signal for forked processes.
 *
 * The supervisor is the only writer of the counters (release stores);
 * workers read them with acquire loads, one per request on the hot path.
 * load_i() keeps the base pointer in C so a read costs one call with one
 * integer argument.
 */
#include <stdint.h>
#include <stddef.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

static uint64_t *g_base = NULL;
static size_t g_n = 0;

uint64_t atomic_load(uint64_t *b, size_t i) {
    return __atomic_load_n(&b[i], __ATOMIC_ACQUIRE);
}

void atomic_store(uint64_t *b, size_t i, uint64_t v) {
    __atomic_store_n(&b[i], v, __ATOMIC_RELEASE);
}

uint64_t atomic_fetch_add(uint64_t *b, size_t i, uint64_t v) {
    return __atomic_fetch_add(&b[i], v, __ATOMIC_ACQ_REL) + v;
}

void set_base(uint64_t *b, size_t n) {
    g_base = b;
    g_n = n;
}

uint64_t load_i(size_t i) {
    return (g_base != NULL && i < g_n) ? __atomic_load_n(&g_base[i], __ATOMIC_ACQUIRE) : 0;
}

/* Ask the kernel to send `sig` to this process when its parent dies.
 * Returns 0 on success, -1 if prctl failed, 1 if the parent is already gone
 * (the caller compares getppid() with the pid it expects). */
int set_pdeathsig(int sig, int expected_parent) {
    if (prctl(PR_SET_PDEATHSIG, sig) != 0) {
        return -1;
    }
    if (getppid() != expected_parent) {
        return 1;
    }
    return 0;
}
