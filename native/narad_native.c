/*
 * narad native helpers: lock-free access to the shared-memory version
 * counter array and a parent-death signal for forked processes.
 *
 * The supervisor is the only writer of the counters (release stores);
 * workers read them with acquire loads, one per request on the hot path.
 * load_i() keeps the base pointer in C so a read costs one call with one
 * integer argument.
 *
 * headers_canonical*() recognise the common text of a batch message's headers
 * (issue 14) so that the produce path can store it as given: see the comment
 * above them. They only ever say "yes, this exact shape" or "no"; every "no"
 * goes through msgspec's decoder (narad.api.messages.batch_headers).
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
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

/* Headers (issue 14). A batch message's headers arrive as the JSON text of the
 * value (msgspec.Raw: the body's decoder checked its syntax and refused raw
 * control characters, but did not read its strings' UTF-8). The produce path
 * stores the text as msgspec would encode the string-to-string dict it holds;
 * these functions say when the text already is that encoding, byte for byte:
 *   {"N":"V"} or {"N":"V","N":"V",...}   nothing else, no spaces
 * with 1 to HDR_MAX_COUNT names, each 1 to HDR_MAX_NAME bytes of
 * [A-Za-z0-9._-] and none twice, every value ASCII from 0x20 to 0x7f except
 * '"' and '\\' (no escape: msgspec escapes only '"', '\\' and control
 * characters and writes DEL as it is), and at most HDR_MAX_BYTES bytes in all.
 * The bounds are narad.api.messages' MAX_HEADERS, MAX_HEADER_NAME and
 * MAX_HEADERS_BYTES (a test checks they agree). */
#define HDR_MAX_COUNT 32
#define HDR_MAX_NAME 128
#define HDR_MAX_BYTES 8192

/* Byte classes: HDR_NAME for [A-Za-z0-9._-], HDR_VALUE for 0x20 to 0x7f except '"'
 * and '\\'; one table read a byte
 * (a test checks the table against those rules). */
#define HDR_NAME 1
#define HDR_VALUE 2
static const unsigned char hdr_class[256] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    2, 2, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2,
    2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 0, 2, 2, 3,
    2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
};

/* 1 when text[0..n) has the shape above, else 0. */
int headers_canonical(const char *text, size_t n) {
    const unsigned char *p = (const unsigned char *)text;
    const unsigned char *names[HDR_MAX_COUNT];
    size_t lens[HDR_MAX_COUNT];
    int k = 0;
    size_t i = 1;
    if (n < 8 || n > HDR_MAX_BYTES || p[0] != '{' || p[n - 1] != '}') {
        return 0;
    }
    for (;;) {
        size_t s, len;
        if (k == HDR_MAX_COUNT || i >= n || p[i] != '"') {
            return 0;
        }
        s = ++i;
        while (i < n && (hdr_class[p[i]] & HDR_NAME)) {
            i++;
        }
        len = i - s;
        if (len == 0 || len > HDR_MAX_NAME || i + 2 >= n || p[i] != '"' || p[i + 1] != ':' || p[i + 2] != '"') {
            return 0;
        }
        for (int j = 0; j < k; j++) {
            if (lens[j] == len && memcmp(names[j], p + s, len) == 0) {
                return 0;
            }
        }
        names[k] = p + s;
        lens[k] = len;
        k++;
        i += 3;
        while (i < n && (hdr_class[p[i]] & HDR_VALUE)) {
            i++;
        }
        if (i + 1 >= n || p[i] != '"') {
            return 0;
        }
        i++;
        if (p[i] == ',') {
            i++;
            continue;
        }
        return (p[i] == '}' && i == n - 1) ? 1 : 0;
    }
}

/* `count` texts joined by NUL bytes (which no JSON text holds): -1 when every
 * one has the shape above, else the index of the first that has not. */
long headers_canonical_all(const char *joined, size_t n, size_t count) {
    size_t start = 0;
    size_t idx = 0;
    for (;;) {
        const char *z = memchr(joined + start, 0, n - start);
        size_t end = z != NULL ? (size_t)(z - joined) : n;
        if (idx >= count || !headers_canonical(joined + start, end - start)) {
            return (long)idx;
        }
        idx++;
        if (z == NULL) {
            break;
        }
        start = end + 1;
    }
    return idx == count ? -1 : (long)idx;
}

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, the crc32c package's and
 * Go's crc32.Castagnoli), for placing a batch's idempotency keys in one call
 * (crc32c_parts). SSE4.2's crc32 instruction when the CPU has it, else a table;
 * tests check both against the crc32c package. */
static uint32_t crc32c_table[256];
static int crc32c_hw = 0; /* 1: SSE4.2's crc32 (decided by crc32c_init at load) */

/* Run when the module is loaded (one thread, under the import lock), so no two
 * threads ever fill the table or decide the CPU's support at once. */
__attribute__((constructor)) static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++) {
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc32c_table[i] = c;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    crc32c_hw = 0;
#endif
}

static uint32_t crc32c_sw(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c = crc32c_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(const unsigned char *p, size_t n) {
    uint64_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n > 0) {
        c32 = __builtin_ia32_crc32qi(c32, *p);
        p++;
        n--;
    }
    return c32 ^ 0xFFFFFFFFu;
}
#endif

/* The CRC-32C of p[0..n); `force_sw` uses the table whatever the CPU has (tests). */
uint32_t crc32c_of(const char *p, size_t n, int force_sw) {
#if defined(__x86_64__)
    if (crc32c_hw == 1 && !force_sw) {
        return crc32c_sse42((const unsigned char *)p, n);
    }
#endif
    return crc32c_sw((const unsigned char *)p, n);
}

/* `count` keys joined by NUL bytes: out[i] = crc32c(key i) % nparts. Returns 0,
 * -1 when the joined bytes do not hold exactly `count` keys (a key holding a NUL:
 * the caller places each key itself) or nparts is 0, or -2 when a key is shorter
 * than `minlen` or longer than `maxlen` bytes. */
static int crc_split(const char *joined, size_t n, size_t count, uint32_t nparts, size_t minlen, size_t maxlen,
                     uint32_t *out, int raw) {
    size_t start = 0;
    size_t idx = 0;
    if (nparts == 0 && !raw) {
        return -1;
    }
    for (;;) {
        const char *z = memchr(joined + start, 0, n - start);
        size_t end = z != NULL ? (size_t)(z - joined) : n;
        if (idx >= count) {
            return -1;
        }
        if (end - start < minlen || end - start > maxlen) {
            return -2;
        }
        uint32_t c = crc32c_of(joined + start, end - start, 0);
        out[idx++] = raw ? c : c % nparts;
        if (z == NULL) {
            break;
        }
        start = end + 1;
    }
    return idx == count ? 0 : -1;
}

/* crc_split for keys of any length (0 or -1). */
int crc32c_parts(const char *joined, size_t n, size_t count, uint32_t nparts, uint32_t *out) {
    return crc_split(joined, n, count, nparts, 0, n, out, 0);
}

/* crc_split with each key's length checked: 0 < length <= maxlen (its UTF-8 bytes);
 * -2 otherwise (the caller's general checks then answer what is wrong). */
int crc32c_parts_max(const char *joined, size_t n, size_t count, uint32_t nparts, size_t maxlen, uint32_t *out) {
    return crc_split(joined, n, count, nparts, 1, maxlen, out, 0);
}

/* Lay `count` records as a frame holds them (frames.lay_keyed's common case: no
 * message key, one flags value, each record's body with its idempotency key's block
 * in front, the key alone as fixstr or str8): for record i, a big-endian u32 of the
 * record's length, then version 3, `flags`, a zero key length, `ts` (big-endian u64),
 * the block's length byte and map head (0x81 0xA1 'i', then 0xA0|m, or 0xD9 m), the
 * key's m bytes and the body. `bodies` holds the bodies back to back (blen[i] bytes
 * each); `keys` the keys joined by NUL bytes (`klen` bytes). Returns the bytes written
 * to `out`, or -1 when a key is empty, 123 bytes or longer, the keys are not exactly
 * `count`, or `cap` is too small: the caller lays them itself. */
long lay_idem(const char *bodies, const uint32_t *blen, const char *keys, size_t klen, size_t count,
              uint8_t flags, uint64_t ts, char *out, size_t cap) {
    size_t kpos = 0;
    size_t bpos = 0;
    size_t w = 0;
    for (size_t i = 0; i < count; i++) {
        if (kpos > klen) {
            return -1;
        }
        const char *z = memchr(keys + kpos, 0, klen - kpos);
        size_t kend = z != NULL ? (size_t)(z - keys) : klen;
        size_t m = kend - kpos;
        if (m == 0 || m >= 123 || (z == NULL) != (i + 1 == count)) {
            return -1;
        }
        size_t b = blen[i];
        size_t bh = m < 32 ? 5 : 6;
        size_t rec = 11 + bh + m + b;
        if (rec > 0xFFFFFFFFu || w + 4 + rec > cap) {
            return -1;
        }
        unsigned char *o = (unsigned char *)out + w;
        o[0] = (unsigned char)(rec >> 24);
        o[1] = (unsigned char)(rec >> 16);
        o[2] = (unsigned char)(rec >> 8);
        o[3] = (unsigned char)rec;
        o[4] = 3;
        o[5] = flags;
        o[6] = 0;
        for (int k = 0; k < 8; k++) {
            o[7 + k] = (unsigned char)(ts >> (56 - 8 * k));
        }
        o += 15;
        if (m < 32) {
            o[0] = (unsigned char)(4 + m);
            o[1] = 0x81;
            o[2] = 0xA1;
            o[3] = 0x69;
            o[4] = (unsigned char)(0xA0 | m);
        } else {
            o[0] = (unsigned char)(5 + m);
            o[1] = 0x81;
            o[2] = 0xA1;
            o[3] = 0x69;
            o[4] = 0xD9;
            o[5] = (unsigned char)m;
        }
        o += bh;
        memcpy(o, keys + kpos, m);
        o += m;
        memcpy(o, bodies + bpos, b);
        bpos += b;
        w += 4 + rec;
        kpos = kend + 1;
    }
    return (long)w;
}

/* A batch's records grouped by partition, in batch order within each (a stable
 * counting sort): perm[starts[p] .. starts[p + 1]) are the indexes i of the records
 * whose parts[i] is p (`starts` has nparts + 1 entries), and nonempty[0 .. k) the
 * partitions that have any, ascending. Returns k, or -1 when a part is not below
 * nparts (or memory is short): the caller groups them itself. */
int group_by_part(const uint32_t *parts, size_t n, uint32_t nparts, uint32_t *perm, uint32_t *starts,
                  uint32_t *nonempty) {
    uint32_t *cursor;
    int k = 0;
    if (nparts == 0) {
        return -1;
    }
    memset(starts, 0, sizeof(uint32_t) * ((size_t)nparts + 1));
    for (size_t i = 0; i < n; i++) {
        if (parts[i] >= nparts) {
            return -1;
        }
        starts[parts[i] + 1]++;
    }
    for (uint32_t p = 0; p < nparts; p++) {
        if (starts[p + 1] != 0) {
            nonempty[k++] = p;
        }
        starts[p + 1] += starts[p];
    }
    cursor = malloc(sizeof(uint32_t) * nparts);
    if (cursor == NULL) {
        return -1;
    }
    memcpy(cursor, starts, sizeof(uint32_t) * nparts);
    for (size_t i = 0; i < n; i++) {
        perm[cursor[parts[i]]++] = (uint32_t)i;
    }
    free(cursor);
    return k;
}

/* 1 when crc32c_of uses SSE4.2's instruction (tests). */
int crc32c_hardware(void) {
    return crc32c_hw;
}

/* ---- The node's idempotency claims table (issue 14) ------------------------------
 * A shared-memory hash table every worker of a node maps read-write: which
 * idempotency keys of which topic were committed on this node (and when), and which
 * are claimed by a produce whose commit is not durable yet.
 * narad/broker/idem_claims.py owns the layout's Python side and says how it is used.
 *
 * Layout: a 384-byte head (counters, the workers' load bits, the sealed homes), then
 * `nbuckets` (a power of two) buckets of 256 bytes: a lock word (the thread id of its holder, 0: free), padding, IDEM_WAYS slots of 40 bytes.
 * A key is its 64-bit fingerprint (fp: the bucket is fp's low bits), its CRC-32C and
 * its topic's 32-bit tag; a slot matches when all three are equal. A slot's `owner` is
 * the single word that makes it valid: 0 empty, IDEM_DONE committed, anything else the
 * tag of the claimer whose commit is pending. A committed slot holds its commit time
 * and `expires` (commit time plus the topic's window when it was stored, or when the
 * window last changed: ``idem_rewindow``): a claim judges a duplicate by its topic's
 * window now, and a slot is free for another key once `expires` passed. A slot is
 * filled field by field and its owner stored last, and emptied (owner 0) before it is
 * refilled, so a holder killed inside a lock leaves no slot that says more than it
 * should. A lock whose holder is gone (kill -9 inside the few instructions it is held)
 * is taken over (head.steals). */
#include <errno.h>
#include <sched.h>
#include <sys/syscall.h>
#include <pthread.h>

#define IDEM_MAGIC 0x4E49444D43540005ULL /* "NIDMCT" + layout version 5 (sealed homes in the head) */
#define IDEM_WAYS 6
#define IDEM_DONE 0xFFFFFFFFu

typedef struct {
    uint64_t fp;
    uint32_t crc;
    uint32_t topic;
    uint64_t committed;
    uint64_t expires;
    uint32_t owner;
    uint32_t home;
} idem_slot;

typedef struct {
    uint64_t lock;
    uint64_t pad;
    idem_slot s[IDEM_WAYS];
} idem_bucket;

/* A home sealed by a move (``idem_seal``): no key homed there is claimed on this node
 * until `until` (ms, wall clock) or until it is unsealed. */
#define IDEM_SEALS 16
typedef struct {
    uint32_t topic;
    uint32_t home;
    uint64_t until;
} idem_seal_t;

typedef struct {
    uint64_t magic;
    uint64_t nbuckets;
    uint64_t check;
    uint64_t evicted;
    uint64_t steals;
    uint64_t full;
    uint64_t seed;
    uint64_t workers;  /* the node's workers, each of which loads its partitions' keys at start */
    uint64_t loaded[4]; /* bit i: worker i has (since the table was made) */
    uint64_t seal_lock; /* held while `seals` is written (a lock word like a bucket's) */
    uint64_t nseals;    /* entries of `seals` in use (live or lapsed): 0, the common case, skips them */
    uint64_t pad[2];
    idem_seal_t seals[IDEM_SEALS];
} idem_head;

_Static_assert(sizeof(idem_slot) == 40, "slot size");
_Static_assert(sizeof(idem_bucket) == 256, "bucket size");
_Static_assert(sizeof(idem_head) == 384, "head size");

size_t idem_size(uint64_t nbuckets) {
    return sizeof(idem_head) + (size_t)nbuckets * sizeof(idem_bucket);
}

/* Lays out a zeroed region of idem_size(nbuckets) bytes; `seed` (random, from the
 * creator) is folded into every fingerprint. */
void idem_init(void *base, uint64_t nbuckets, uint64_t check, uint64_t seed) {
    idem_head *h = (idem_head *)base;
    h->nbuckets = nbuckets;
    h->check = check;
    h->seed = seed;
    __atomic_store_n(&h->magic, IDEM_MAGIC, __ATOMIC_RELEASE);
}

int idem_all_loaded(const void *base);

/* The node's worker count (the supervisor, once). */
void idem_set_workers(void *base, uint64_t n) {
    __atomic_store_n(&((idem_head *)base)->workers, n, __ATOMIC_RELEASE);
}

/* Worker `index` has loaded the keys of its partitions. Returns 1 when every worker has. */
int idem_set_loaded(void *base, uint32_t index) {
    idem_head *h = (idem_head *)base;
    if (index < 256) {
        __atomic_fetch_or(&h->loaded[index / 64], 1ULL << (index % 64), __ATOMIC_ACQ_REL);
    }
    return idem_all_loaded(base);
}

/* 1 when every worker has loaded the keys of its partitions since the table was made. */
int idem_all_loaded(const void *base) {
    const idem_head *h = (const idem_head *)base;
    uint64_t n = __atomic_load_n(&h->workers, __ATOMIC_ACQUIRE);
    for (uint64_t i = 0; i < n && i < 256; i++) {
        if (!(__atomic_load_n(&h->loaded[i / 64], __ATOMIC_ACQUIRE) & (1ULL << (i % 64)))) {
            return 0;
        }
    }
    return 1;
}

/* 0 when `base` holds a table made with `check`, else -1. */
int idem_check(const void *base, uint64_t check) {
    const idem_head *h = (const idem_head *)base;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != IDEM_MAGIC || h->check != check || h->nbuckets == 0 ||
        (h->nbuckets & (h->nbuckets - 1)) != 0) {
        return -1;
    }
    return 0;
}

/* A key's fingerprint: FNV-1a over its bytes from the table's seed, then MurmurHash3's
 * 64-bit finaliser (so the low bits, the bucket, depend on every byte). Not a keyed
 * PRF: a producer who knows another's key can take it with a produce anyway; the seed
 * only keeps keys chosen to crowd one bucket from being found offline. */
static uint64_t idem_fp(uint64_t seed, const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL ^ seed;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* `count` keys back to back in joined[0..n), key i lens[i] bytes: fp[i] and crc[i] of
 * each. 0, -1 when the lengths do not add up to n, -2 when a key is longer than maxlen. */
int idem_prepare(const void *base, const char *joined, size_t n, size_t count, const uint32_t *lens, size_t maxlen,
                 uint64_t *fp, uint32_t *crc) {
    uint64_t seed = ((const idem_head *)base)->seed;
    size_t start = 0;
    for (size_t i = 0; i < count; i++) {
        size_t m = lens[i];
        if (m > maxlen) {
            return -2;
        }
        if (m > n - start) {
            return -1;
        }
        fp[i] = idem_fp(seed, (const unsigned char *)joined + start, m);
        crc[i] = crc32c_of(joined + start, m, 0);
        start += m;
    }
    return start == n ? 0 : -1;
}

/* A key's two buckets (two-choice hashing: fp's low bits and its high 32 bits), locked
 * in ascending order (one when both are the same), so that no two lockers wait for each
 * other. A key lives in one slot of one of them; a new key goes to the one with fewer
 * live slots: the table fills evenly to a high load before a bucket must evict. */
typedef struct {
    idem_bucket *b[2];
    int n;
} idem_pair;

static void idem_lock(void *base, uint64_t *word);
static void idem_unlock(uint64_t *word);

static void idem_pair_lock(void *base, uint64_t fp, idem_pair *p) {
    idem_head *h = (idem_head *)base;
    idem_bucket *bs = (idem_bucket *)((char *)base + sizeof(idem_head));
    uint64_t m = h->nbuckets - 1;
    uint64_t i1 = fp & m, i2 = (fp >> 32) & m;
    if (i1 == i2) {
        p->n = 1;
        p->b[0] = &bs[i1];
    } else {
        p->n = 2;
        p->b[0] = &bs[i1 < i2 ? i1 : i2];
        p->b[1] = &bs[i1 < i2 ? i2 : i1];
    }
    for (int k = 0; k < p->n; k++) {
        idem_lock(base, &p->b[k]->lock);
    }
}

static void idem_pair_unlock(idem_pair *p) {
    for (int k = p->n - 1; k >= 0; k--) {
        idem_unlock(&p->b[k]->lock);
    }
}

/* The calling thread's id, the lock word's holder mark. Read from the kernel once a
 * thread (a system call a lock was measurable in the per-message instruction count) and
 * forgotten in a forked child, whose only thread has a new id. */
static __thread uint64_t idem_tid_cached;

static void idem_tid_forget(void) {
    idem_tid_cached = 0;
}

__attribute__((constructor)) static void idem_tid_init(void) {
    pthread_atfork(NULL, NULL, idem_tid_forget);
}

static uint64_t idem_tid(void) {
    if (idem_tid_cached == 0) {
        idem_tid_cached = (uint64_t)syscall(SYS_gettid);
    }
    return idem_tid_cached;
}

/* The mark this thread puts in a lock word it holds (for tests: a forked child's differs). */
uint64_t idem_holder_mark(void) {
    return idem_tid();
}

static void idem_lock(void *base, uint64_t *word) {
    uint64_t me = idem_tid();
    unsigned spins = 0;
    for (;;) {
        uint64_t cur = 0;
        if (__atomic_compare_exchange_n(word, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            return;
        }
        spins++;
        if (spins < 100) {
            continue;
        }
        if (spins % 100 == 0 && cur != me && kill((pid_t)cur, 0) != 0 && errno == ESRCH) {
            /* its holder is gone: taken over */
            if (__atomic_compare_exchange_n(word, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
                __atomic_fetch_add(&((idem_head *)base)->steals, 1, __ATOMIC_RELAXED);
                return;
            }
        }
        sched_yield();
    }
}

static void idem_unlock(uint64_t *word) {
    __atomic_store_n(word, 0, __ATOMIC_RELEASE);
}

static idem_slot *idem_find(idem_bucket *b, uint64_t fp, uint32_t crc, uint32_t topic) {
    for (int w = 0; w < IDEM_WAYS; w++) {
        idem_slot *s = &b->s[w];
        if (s->owner != 0 && s->fp == fp && s->crc == crc && s->topic == topic) {
            return s;
        }
    }
    return NULL;
}

static idem_slot *idem_find2(idem_pair *p, uint64_t fp, uint32_t crc, uint32_t topic) {
    for (int k = 0; k < p->n; k++) {
        idem_slot *s = idem_find(p->b[k], fp, crc, topic);
        if (s != NULL) {
            return s;
        }
    }
    return NULL;
}

static int idem_free_here(const idem_slot *s, uint64_t now) {
    return s->owner == 0 || (s->owner == IDEM_DONE && s->expires <= now);
}

/* A slot for a new key in its two buckets: a free one (empty, or its window passed) in
 * the bucket with fewer live slots, else in the other, else the committed one of both
 * that expires first (evicted: *evicted += 1); NULL when every slot is pending. */
static idem_slot *idem_free_slot(idem_pair *p, uint64_t now, long *evicted) {
    int live[2] = {0, 0};
    for (int k = 0; k < p->n; k++) {
        for (int w = 0; w < IDEM_WAYS; w++) {
            live[k] += !idem_free_here(&p->b[k]->s[w], now);
        }
    }
    int first = (p->n == 2 && live[1] < live[0]) ? 1 : 0;
    for (int j = 0; j < p->n; j++) {
        idem_bucket *b = p->b[(first + j) % p->n];
        for (int w = 0; w < IDEM_WAYS; w++) {
            if (idem_free_here(&b->s[w], now)) {
                return &b->s[w];
            }
        }
    }
    idem_slot *oldest = NULL;
    for (int k = 0; k < p->n; k++) {
        for (int w = 0; w < IDEM_WAYS; w++) {
            idem_slot *s = &p->b[k]->s[w];
            if (s->owner == IDEM_DONE && (oldest == NULL || s->expires < oldest->expires)) {
                oldest = s;
            }
        }
    }
    if (oldest != NULL) {
        (*evicted)++;
    }
    return oldest;
}

/* A key's home partition: `home` (or homes[i] when homes is given), unless its high bit
 * is set: then the key's CRC-32C modulo the rest (the partition a keyless idempotent
 * record's key hashes to: what a move of that partition must carry). */
#define IDEM_HOME_BY_KEY 0x80000000u
static uint32_t idem_home(uint32_t home, const uint32_t *homes, size_t i, uint32_t crc) {
    uint32_t h = homes != NULL ? homes[i] : home;
    if (h & IDEM_HOME_BY_KEY) {
        uint32_t np = h & ~IDEM_HOME_BY_KEY;
        return np ? crc % np : 0;
    }
    return h;
}

static void idem_fill(idem_slot *s, uint64_t fp, uint32_t crc, uint32_t topic, uint32_t home, uint64_t committed,
                      uint64_t expires, uint32_t owner) {
    __atomic_store_n(&s->owner, 0, __ATOMIC_RELEASE);
    s->fp = fp;
    s->crc = crc;
    s->topic = topic;
    s->home = home;
    s->committed = committed;
    s->expires = expires;
    __atomic_store_n(&s->owner, owner, __ATOMIC_RELEASE);
}

/* 1 when `home` of `topic` is sealed at `now` (read under a bucket's lock: see idem_seal). */
static int idem_sealed(const idem_head *h, uint32_t topic, uint32_t home, uint64_t now) {
    uint64_t n = __atomic_load_n(&h->nseals, __ATOMIC_ACQUIRE);
    for (uint64_t i = 0; i < n && i < IDEM_SEALS; i++) {
        const idem_seal_t *e = &h->seals[i];
        if (__atomic_load_n(&e->until, __ATOMIC_ACQUIRE) > now && e->topic == topic && e->home == home) {
            return 1;
        }
    }
    return 0;
}

/* Drops the lapsed seals at the end of the list (so that `nseals` falls back to 0, the
 * claims' fast path, once no seal is live). Under seal_lock. */
static void idem_seals_trim(idem_head *h, uint64_t now) {
    uint64_t n = h->nseals;
    while (n > 0 && h->seals[n - 1].until <= now) {
        n--;
    }
    __atomic_store_n(&h->nseals, n, __ATOMIC_RELEASE);
}

/* Seals `home` of `topic` until `until` (ms, wall clock; a later `until` extends a seal
 * held already): once this returns, no key homed there is claimed on this node
 * (idem_claim answers 4) while the seal holds. A move's source seals its partition before
 * it collects the keys homed there, so that a key placed elsewhere on this node by a
 * worker that did not know of the move yet is refused instead of missed by the carry.
 * After the seal is written every bucket is locked once: a claim that did not see the
 * seal had finished by then, so its pending claim is seen by idem_pending_home. Returns
 * 0, or -1 when IDEM_SEALS seals are live already. */
int idem_seal(void *base, uint32_t topic, uint32_t home, uint64_t until, uint64_t now) {
    idem_head *h = (idem_head *)base;
    idem_bucket *bs = (idem_bucket *)((char *)base + sizeof(idem_head));
    idem_lock(base, &h->seal_lock);
    uint64_t n = h->nseals;
    idem_seal_t *spare = NULL;
    int held = 0;
    for (uint64_t i = 0; i < n; i++) {
        idem_seal_t *e = &h->seals[i];
        if (e->topic == topic && e->home == home && e->until > now) {
            if (until > e->until) {
                __atomic_store_n(&e->until, until, __ATOMIC_RELEASE);
            }
            held = 1;
            break;
        }
        if (e->until <= now && spare == NULL) {
            spare = e;
        }
    }
    if (!held) {
        if (spare != NULL) { /* a lapsed entry, refilled: it says nothing until its `until` is stored */
            __atomic_store_n(&spare->until, 0, __ATOMIC_RELEASE);
            spare->topic = topic;
            spare->home = home;
            __atomic_store_n(&spare->until, until, __ATOMIC_RELEASE);
        } else if (n < IDEM_SEALS) {
            h->seals[n].topic = topic;
            h->seals[n].home = home;
            h->seals[n].until = until;
            __atomic_store_n(&h->nseals, n + 1, __ATOMIC_RELEASE);
        } else {
            idem_unlock(&h->seal_lock);
            return -1;
        }
    }
    idem_seals_trim(h, now);
    idem_unlock(&h->seal_lock);
    for (uint64_t k = 0; k < h->nbuckets; k++) {
        idem_lock(base, &bs[k].lock);
        idem_unlock(&bs[k].lock);
    }
    return 0;
}

/* Lifts the seal of `home` of `topic` (the move was given up, or the partition came back
 * to this node), and drops lapsed seals at the list's end. */
void idem_unseal(void *base, uint32_t topic, uint32_t home, uint64_t now) {
    idem_head *h = (idem_head *)base;
    idem_lock(base, &h->seal_lock);
    for (uint64_t i = 0; i < h->nseals; i++) {
        idem_seal_t *e = &h->seals[i];
        if (e->topic == topic && e->home == home) {
            __atomic_store_n(&e->until, 0, __ATOMIC_RELEASE);
        }
    }
    idem_seals_trim(h, now);
    idem_unlock(&h->seal_lock);
}

/* Seals live at `now` (for the metrics and tests). */
long idem_sealed_count(const void *base, uint64_t now) {
    const idem_head *h = (const idem_head *)base;
    uint64_t n = __atomic_load_n(&h->nseals, __ATOMIC_ACQUIRE);
    long live = 0;
    for (uint64_t i = 0; i < n && i < IDEM_SEALS; i++) {
        live += __atomic_load_n(&h->seals[i].until, __ATOMIC_ACQUIRE) > now;
    }
    return live;
}

/* Claims n keys of one topic for `tag` (a claimer's tag: neither 0 nor IDEM_DONE), at
 * `now` with the topic's window `window` (ms). out[i]: 0 claimed (pending under tag),
 * 1 committed within the window (a duplicate), 2 pending under some claimer (this one
 * included), 3 not claimed: its bucket holds nothing but pending claims, 4 not claimed:
 * its home is sealed (idem_seal: a move is carrying that partition's keys away). Returns
 * the committed keys evicted to make room, or -1 for a bad tag. */
long idem_claim(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic, uint32_t home,
                const uint32_t *homes, uint64_t now, uint64_t window, uint32_t tag, uint8_t *out) {
    long evicted = 0;
    if (tag == 0 || tag == IDEM_DONE) {
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        idem_pair p;
        idem_pair_lock(base, fp[i], &p);
        idem_slot *s = idem_find2(&p, fp[i], crc[i], topic);
        if (s != NULL && s->owner != IDEM_DONE) {
            out[i] = 2;
        } else if (s != NULL && s->committed + window > now) {
            out[i] = 1;
        } else {
            uint32_t hm = idem_home(home, homes, i, crc[i]);
            if (__atomic_load_n(&((idem_head *)base)->nseals, __ATOMIC_ACQUIRE) != 0 &&
                idem_sealed((idem_head *)base, topic, hm, now)) {
                out[i] = 4;
                idem_pair_unlock(&p);
                continue;
            }
            if (s == NULL) {
                s = idem_free_slot(&p, now, &evicted);
            }
            if (s == NULL) {
                out[i] = 3;
                __atomic_fetch_add(&((idem_head *)base)->full, 1, __ATOMIC_RELAXED);
            } else {
                idem_fill(s, fp[i], crc[i], topic, hm, 0, 0, tag);
                out[i] = 0;
            }
        }
        idem_pair_unlock(&p);
    }
    if (evicted) {
        __atomic_fetch_add(&((idem_head *)base)->evicted, (uint64_t)evicted, __ATOMIC_RELAXED);
    }
    return evicted;
}

/* idem_prepare then idem_claim in one call (the commit path's: one call a batch). */
long idem_prepare_claim(void *base, const char *joined, size_t nbytes, size_t count, const uint32_t *lens,
                        size_t maxlen, uint32_t topic, uint32_t home, const uint32_t *homes, uint64_t now,
                        uint64_t window, uint32_t tag,
                        uint64_t *fp, uint32_t *crc, uint8_t *out) {
    int rc = idem_prepare(base, joined, nbytes, count, lens, maxlen, fp, crc);
    if (rc != 0) {
        return rc - 10; /* -11, -12: idem_prepare's -1, -2 */
    }
    return idem_claim(base, count, fp, crc, topic, home, homes, now, window, tag, out);
}

/* Settles the claims of `tag` on the keys whose mask[i] is set (every key as `mode`
 * when mask is NULL): 1 committed at `committed` (a slot until committed + window), 2
 * released (the commit failed: the key is free again). A key no longer pending under
 * `tag` is left as it is. Returns the number settled. */
long idem_settle(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic, uint32_t tag,
                 uint64_t committed, uint64_t window, const uint8_t *mask, uint8_t mode) {
    long done = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t m = mask != NULL ? mask[i] : mode;
        if (m != 1 && m != 2) {
            continue;
        }
        idem_pair p;
        idem_pair_lock(base, fp[i], &p);
        idem_slot *s = idem_find2(&p, fp[i], crc[i], topic);
        if (s != NULL && s->owner == tag) {
            if (m == 1) {
                s->committed = committed;
                s->expires = committed + window;
                __atomic_store_n(&s->owner, IDEM_DONE, __ATOMIC_RELEASE);
            } else {
                __atomic_store_n(&s->owner, 0, __ATOMIC_RELEASE);
            }
            done++;
        }
        idem_pair_unlock(&p);
    }
    return done;
}

/* Records keys found committed at committed[i] (a rebuild from a log, keys carried by a
 * move), each a slot until committed[i] + window; the later commit of two when it is
 * held already; a pending claim on it becomes that commit (the record is durable). Keys
 * whose window passed are skipped. Returns the committed keys evicted to make room. */
long idem_load(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic, const uint32_t *home,
               const uint64_t *committed, uint64_t window, uint64_t now) {
    long evicted = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t expires = committed[i] + window;
        if (expires <= now) {
            continue;
        }
        idem_pair p;
        idem_pair_lock(base, fp[i], &p);
        idem_slot *s = idem_find2(&p, fp[i], crc[i], topic);
        if (s != NULL) {
            if (s->owner != IDEM_DONE || s->committed < committed[i]) {
                s->committed = committed[i];
                s->expires = expires;
                __atomic_store_n(&s->owner, IDEM_DONE, __ATOMIC_RELEASE);
            }
        } else {
            s = idem_free_slot(&p, now, &evicted);
            if (s != NULL) {
                idem_fill(s, fp[i], crc[i], topic, idem_home(0, home, i, crc[i]), committed[i], expires, IDEM_DONE);
            } else {
                __atomic_fetch_add(&((idem_head *)base)->full, 1, __ATOMIC_RELAXED);
            }
        }
        idem_pair_unlock(&p);
    }
    if (evicted) {
        __atomic_fetch_add(&((idem_head *)base)->evicted, (uint64_t)evicted, __ATOMIC_RELAXED);
    }
    return evicted;
}

/* The whole-table sweeps: IDEM_SWEEP_WINDOW (the committed keys of topic `a`: each holds
 * its slot until its commit plus `v`) and IDEM_SWEEP_RELEASE (the pending claims whose
 * owner & `a` == `b`: emptied). A bucket without a matching slot is passed over without
 * its lock (a moment's view: a slot that comes to match meanwhile is a later event).
 * Returns the slots acted on. */
#define IDEM_SWEEP_WINDOW 0
#define IDEM_SWEEP_RELEASE 1
static int idem_sweep_match(uint32_t owner, const idem_slot *s, int kind, uint32_t a, uint32_t b) {
    if (kind == IDEM_SWEEP_WINDOW) {
        return owner == IDEM_DONE && s->topic == a;
    }
    return owner != 0 && owner != IDEM_DONE && (owner & a) == b;
}

static long idem_sweep(void *base, int kind, uint32_t a, uint32_t b, uint64_t v) {
    idem_head *h = (idem_head *)base;
    idem_bucket *bs = (idem_bucket *)((char *)base + sizeof(idem_head));
    long done = 0;
    for (uint64_t k = 0; k < h->nbuckets; k++) {
        idem_bucket *bk = &bs[k];
        int any = 0;
        for (int w = 0; w < IDEM_WAYS && !any; w++) {
            any = idem_sweep_match(__atomic_load_n(&bk->s[w].owner, __ATOMIC_ACQUIRE), &bk->s[w], kind, a, b);
        }
        if (!any) {
            continue;
        }
        idem_lock(base, &bk->lock);
        for (int w = 0; w < IDEM_WAYS; w++) {
            idem_slot *s = &bk->s[w];
            if (!idem_sweep_match(s->owner, s, kind, a, b)) {
                continue;
            }
            if (kind == IDEM_SWEEP_WINDOW) {
                s->expires = s->committed + v;
            } else {
                __atomic_store_n(&s->owner, 0, __ATOMIC_RELEASE);
            }
            done++;
        }
        idem_unlock(&bk->lock);
    }
    return done;
}

/* A topic's window changed: each of its committed keys holds a slot until its commit plus
 * `window` from now on (a claim judges by the window it is given already). Returns how
 * many keys of the topic there were. */
long idem_rewindow(void *base, uint32_t topic, uint64_t window) {
    return idem_sweep(base, IDEM_SWEEP_WINDOW, topic, 0, window);
}

/* Empties every pending claim whose owner & mask == value (a dead claimer's). Returns
 * how many. */
long idem_release_owner(void *base, uint32_t mask, uint32_t value) {
    return idem_sweep(base, IDEM_SWEEP_RELEASE, mask, value, 0);
}

/* The committed keys of `topic` whose home partition is `home` and which hold a slot at
 * `now`, from bucket *cursor on: at most cap of them into fp/crc/committed; *cursor is
 * where the next call goes on (nbuckets: done). Returns how many were written. */
long idem_collect(void *base, uint32_t topic, uint32_t home, uint64_t now, uint64_t *fp, uint32_t *crc,
                  uint64_t *committed, size_t cap, uint64_t *cursor) {
    idem_head *h = (idem_head *)base;
    idem_bucket *bs = (idem_bucket *)((char *)base + sizeof(idem_head));
    size_t got = 0;
    uint64_t k = *cursor;
    for (; k < h->nbuckets && got + IDEM_WAYS <= cap; k++) {
        idem_bucket *b = &bs[k];
        idem_lock(base, &b->lock);
        for (int w = 0; w < IDEM_WAYS; w++) {
            idem_slot *s = &b->s[w];
            if (s->owner == IDEM_DONE && s->topic == topic && s->home == home && s->expires > now) {
                fp[got] = s->fp;
                crc[got] = s->crc;
                committed[got] = s->committed;
                got++;
            }
        }
        idem_unlock(&b->lock);
    }
    *cursor = k;
    return (long)got;
}

/* Pending claims of `topic` whose home partition is `home` (without locks: a moment's view). */
long idem_pending_home(const void *base, uint32_t topic, uint32_t home) {
    const idem_head *h = (const idem_head *)base;
    const idem_bucket *bs = (const idem_bucket *)((const char *)base + sizeof(idem_head));
    long n = 0;
    for (uint64_t k = 0; k < h->nbuckets; k++) {
        for (int w = 0; w < IDEM_WAYS; w++) {
            uint32_t o = __atomic_load_n(&bs[k].s[w].owner, __ATOMIC_ACQUIRE);
            if (o != 0 && o != IDEM_DONE && bs[k].s[w].topic == topic && bs[k].s[w].home == home) {
                n++;
            }
        }
    }
    return n;
}

/* Counts without locks (a moment's view): out[0] committed keys holding a slot at `now`,
 * out[1] pending, out[2] evicted so far, out[3] locks taken over, out[4] keys refused
 * for a bucket of pending claims. */
void idem_stats(const void *base, uint64_t now, uint64_t *out) {
    const idem_head *h = (const idem_head *)base;
    const idem_bucket *bs = (const idem_bucket *)((const char *)base + sizeof(idem_head));
    uint64_t live = 0, pending = 0;
    for (uint64_t k = 0; k < h->nbuckets; k++) {
        for (int w = 0; w < IDEM_WAYS; w++) {
            uint32_t o = __atomic_load_n(&bs[k].s[w].owner, __ATOMIC_RELAXED);
            if (o == IDEM_DONE) {
                live += bs[k].s[w].expires > now;
            } else if (o != 0) {
                pending++;
            }
        }
    }
    out[0] = live;
    out[1] = pending;
    out[2] = __atomic_load_n(&h->evicted, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&h->steals, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&h->full, __ATOMIC_RELAXED);
}
