"""cffi build script for narad's native helpers (``narad._native``).

Built at install time through ``cffi_modules`` in setup.py; the C source is
``native/narad_native.c``. Nothing here runs at import time.
"""

from pathlib import Path

from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef(
    """
    uint64_t atomic_load(uint64_t *b, size_t i);
    void atomic_store(uint64_t *b, size_t i, uint64_t v);
    uint64_t atomic_fetch_add(uint64_t *b, size_t i, uint64_t v);
    void set_base(uint64_t *b, size_t n);
    uint64_t load_i(size_t i);
    int set_pdeathsig(int sig, int expected_parent);
    int headers_canonical(const char *text, size_t n);
    long headers_canonical_all(const char *joined, size_t n, size_t count);
    uint32_t crc32c_of(const char *p, size_t n, int force_sw);
    int crc32c_hardware(void);
    int crc32c_parts(const char *joined, size_t n, size_t count, uint32_t nparts, uint32_t *out);
    int crc32c_parts_max(const char *joined, size_t n, size_t count, uint32_t nparts, size_t maxlen, uint32_t *out);
    long lay_idem(const char *bodies, const uint32_t *blen, const char *keys, size_t klen, size_t count,
                  uint8_t flags, uint64_t ts, char *out, size_t cap);
    size_t idem_size(uint64_t nbuckets);
    void idem_init(void *base, uint64_t nbuckets, uint64_t check, uint64_t seed);
    int idem_prepare(const void *base, const char *joined, size_t n, size_t count, const uint32_t *lens,
                     size_t maxlen, uint64_t *fp, uint32_t *crc);
    int idem_check(const void *base, uint64_t check);
    void idem_set_workers(void *base, uint64_t n);
    int idem_set_loaded(void *base, uint32_t index);
    int idem_all_loaded(const void *base);
    long idem_claim(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic,
                    uint32_t home, const uint32_t *homes, uint64_t now, uint64_t window, uint32_t tag, uint8_t *out);
    long idem_prepare_claim(void *base, const char *joined, size_t nbytes, size_t count, const uint32_t *lens,
                            size_t maxlen, uint32_t topic, uint32_t home, const uint32_t *homes, uint64_t now,
                            uint64_t window, uint32_t tag, uint64_t *fp, uint32_t *crc, uint8_t *out);
    long idem_settle(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic, uint32_t tag,
                     uint64_t committed, uint64_t window, const uint8_t *mask, uint8_t mode);
    long idem_load(void *base, size_t n, const uint64_t *fp, const uint32_t *crc, uint32_t topic,
                   const uint32_t *home, const uint64_t *committed, uint64_t window, uint64_t now);
    long idem_rewindow(void *base, uint32_t topic, uint64_t window);
    long idem_release_owner(void *base, uint32_t mask, uint32_t value);
    long idem_collect(void *base, uint32_t topic, uint32_t home, uint64_t now, uint64_t *fp, uint32_t *crc,
                      uint64_t *committed, size_t cap, uint64_t *cursor);
    long idem_pending_home(const void *base, uint32_t topic, uint32_t home);
    void idem_stats(const void *base, uint64_t now, uint64_t *out);
    uint64_t idem_holder_mark(void);
    int idem_seal(void *base, uint32_t topic, uint32_t home, uint64_t until, uint64_t now);
    void idem_unseal(void *base, uint32_t topic, uint32_t home, uint64_t now);
    long idem_sealed_count(const void *base, uint64_t now);
    int group_by_part(const uint32_t *parts, size_t n, uint32_t nparts, uint32_t *perm, uint32_t *starts,
                      uint32_t *nonempty);
    """
)
_src = (Path(__file__).resolve().parent / "narad_native.c").read_text()
ffibuilder.set_source("narad._native", _src, extra_compile_args=["-O2"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
