/* kvs128: the native kernel of kvsched's default block identity (see identity.py, which also
 * holds the pure-Python reference this must equal bit for bit).
 *
 * One block's digest, from its parent's digest (p0, p1), its bytes and its extra bytes. All
 * arithmetic is modulo 2**64, words are little-endian u64, K[0..73] are derived from the
 * namespace root (identity.py):
 *
 *   the block's bytes, zero-padded to whole 64-byte stripes, are words w[i]; word i has the
 *   key k(i) = K[i mod 64] + (i div 64) * P1, and d = w[i] ^ k(i) adds to lane l = i mod 8:
 *       acc[l] += (d mod 2**32) * (d div 2**32) + w[i ^ 1]
 *   the extra bytes (zero-padded the same way) continue into the same lanes with word
 *   indices from EXTRA_WORD0 on;
 *   fold(a, b) = lo ^ hi of the 128-bit product a * b;
 *   u = fold(acc0 ^ K64, acc1 ^ K65) + fold(acc2 ^ K66, acc3 ^ K67),
 *   v = fold(acc4 ^ K68, acc5 ^ K69) + fold(acc6 ^ K70, acc7 ^ K71);
 *   x0 = p0 ^ u ^ (len(extra) * P3), x1 = p1 ^ v;
 *   lo, hi = 128-bit product (x0 ^ K72) * (x1 ^ K73);  h0 = mix(lo + x1), h1 = mix(hi + x0)
 *   with mix(h) = g ^ (g >> 32), g = (h ^ (h >> 37)) * PM;  digest = h0 || h1.
 *
 * The lanes are AVX2 where the CPU has it (four per register), else SSE2 (x86-64's baseline:
 * two per register; one 32x32->64 product per word); elsewhere a scalar loop computes the
 * same. Only the finaliser depends on the parent
 * (a short critical path from block to block): the next block's stripes overlap with it. On
 * the AVX2 path a chain of blocks of whole stripes without extras runs in one loop
 * (chain_avx2), with nothing between one block and the next that would stop that overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

#define NKEYS 74
#define DIGEST 16
#define STRIPE 64
#define P1 0x9E3779B97F4A7C15ULL
#define P3 0x165667B19E3779F9ULL
#define PM 0x165667919E3779F9ULL
#define M32 0xFFFFFFFFULL
#define EXTRA_WORD0 (1ULL << 40)
#define FIELD_BLOCK 1024 /* bytes per block of digest() */
/* Tokens arriving from DRAM: the finaliser's chain from block to block keeps the core from
 * running far ahead, so the stripes 4 KiB ahead are requested explicitly (cold 256 KiB of
 * tokens: 45 -> 28 us here; a prefetch past the end is harmless). */
#define PREFETCH_AHEAD 4096
#if defined(__GNUC__)
#define PREFETCH(addr) __builtin_prefetch((addr))
#else
#define PREFETCH(addr) ((void)0)
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE64(v) __builtin_bswap64(v)
#define NATIVE_LANES 0
#else
#define LE64(v) (v)
#define NATIVE_LANES 1
#endif

static inline uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return LE64(v);
}

static inline void wr64(unsigned char *p, uint64_t v) {
    v = LE64(v);
    memcpy(p, &v, 8);
}

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 37;
    h *= PM;
    return h ^ (h >> 32);
}

static inline void mul128(uint64_t a, uint64_t b, uint64_t *lo, uint64_t *hi) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 r = (unsigned __int128)a * b;
    *lo = (uint64_t)r;
    *hi = (uint64_t)(r >> 64);
#else
    uint64_t al = a & M32, ah = a >> 32, bl = b & M32, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (lh & M32) + (hl & M32);
    *lo = (mid << 32) | (ll & M32);
    *hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
#endif
}

static inline uint64_t fold(uint64_t a, uint64_t b) {
    uint64_t lo, hi;
    mul128(a, b, &lo, &hi);
    return lo ^ hi;
}

static inline uint64_t word_key(const uint64_t *K, uint64_t i) { return K[i & 63] + (i >> 6) * P1; }

/* One zero-padded stripe (8 words) into the lanes, keys kk[0..7]. */
static inline void stripe_scalar(uint64_t *acc, const unsigned char *p, const uint64_t *kk) {
    uint64_t w[8];
    for (int l = 0; l < 8; l++) w[l] = rd64(p + 8 * l);
    for (int l = 0; l < 8; l++) {
        uint64_t d = w[l] ^ kk[l];
        acc[l] += (d & M32) * (d >> 32) + w[l ^ 1];
    }
}

/* Bytes past the whole stripes, or extra bytes: zero-padded stripes, keys of word index
 * ``word`` on (computed here: the rare path). */
static void absorb_tail(uint64_t *acc, const unsigned char *p, Py_ssize_t n, const uint64_t *K,
                        uint64_t word) {
    for (; n > 0; n -= STRIPE, p += STRIPE, word += 8) {
        unsigned char pad[STRIPE] = {0};
        uint64_t kk[8];
        memcpy(pad, p, (size_t)(n < STRIPE ? n : STRIPE));
        for (int l = 0; l < 8; l++) kk[l] = word_key(K, word + (uint64_t)l);
        stripe_scalar(acc, pad, kk);
    }
}

/* The whole stripes of a block's bytes into the 8 lanes, keys from the per-call table kk (8
 * per stripe). Three loops compute the same lanes: scalar (anywhere), SSE2 (two lanes per
 * register, x86-64's baseline) and AVX2 (four per register, where the CPU has it); the
 * in-register swap of 64-bit halves is w[i ^ 1]. ``_kvs128.use(path)`` picks one (tests run
 * each against the Python specification); by default the fastest the CPU has. */
typedef void (*absorb_fn)(uint64_t *, const unsigned char *, Py_ssize_t, const uint64_t *,
                          uint32_t *);

/* Each loop also keeps the largest token id it read, as unsigned 32-bit (a negative id is
 * larger than any vocabulary), for the arrival's vocabulary check in the same pass. */
static inline uint32_t max_scalar(const unsigned char *p, Py_ssize_t nbytes, uint32_t mx) {
    for (Py_ssize_t i = 0; i + 4 <= nbytes; i += 4) {
        uint32_t t;
        memcpy(&t, p + i, 4);
#if !NATIVE_LANES
        t = __builtin_bswap32(t);
#endif
        mx = t > mx ? t : mx;
    }
    return mx;
}

static void absorb_scalar(uint64_t *acc, const unsigned char *p, Py_ssize_t nstripes,
                          const uint64_t *kk, uint32_t *mx) {
    for (int l = 0; l < 8; l++) acc[l] = 0;
    *mx = max_scalar(p, nstripes * STRIPE, *mx);
    for (Py_ssize_t j = 0; j < nstripes; j++, p += STRIPE, kk += 8) {
        PREFETCH(p + PREFETCH_AHEAD);
        stripe_scalar(acc, p, kk);
    }
}

#if defined(__SSE2__) && NATIVE_LANES
#define SSE2_LANES(a, w, d) \
    a = _mm_add_epi64(a, _mm_add_epi64(_mm_mul_epu32(d, _mm_srli_epi64(d, 32)), \
                                       _mm_shuffle_epi32(w, 0x4E)))

/* Unsigned 32-bit max in SSE2 (no pmaxud): compare with the sign bit flipped. */
#define SSE2_MAX(m, w)                                               \
    do {                                                             \
        __m128i x_ = _mm_xor_si128(w, bias);                         \
        __m128i gt_ = _mm_cmpgt_epi32(x_, m);                        \
        m = _mm_or_si128(_mm_and_si128(gt_, x_), _mm_andnot_si128(gt_, m)); \
    } while (0)

static void absorb_sse2(uint64_t *acc, const unsigned char *p, Py_ssize_t nstripes,
                        const uint64_t *kk, uint32_t *mx) {
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    const __m128i bias = _mm_set1_epi32((int)0x80000000u);
    __m128i m = _mm_xor_si128(_mm_set1_epi32((int)*mx), bias);
    for (Py_ssize_t j = 0; j < nstripes; j++, p += STRIPE, kk += 8) {
        PREFETCH(p + PREFETCH_AHEAD);
        __m128i w0 = _mm_loadu_si128((const __m128i *)p);
        __m128i w1 = _mm_loadu_si128((const __m128i *)(p + 16));
        __m128i w2 = _mm_loadu_si128((const __m128i *)(p + 32));
        __m128i w3 = _mm_loadu_si128((const __m128i *)(p + 48));
        __m128i d0 = _mm_xor_si128(w0, _mm_loadu_si128((const __m128i *)kk));
        __m128i d1 = _mm_xor_si128(w1, _mm_loadu_si128((const __m128i *)(kk + 2)));
        __m128i d2 = _mm_xor_si128(w2, _mm_loadu_si128((const __m128i *)(kk + 4)));
        __m128i d3 = _mm_xor_si128(w3, _mm_loadu_si128((const __m128i *)(kk + 6)));
        SSE2_LANES(a0, w0, d0);
        SSE2_LANES(a1, w1, d1);
        SSE2_LANES(a2, w2, d2);
        SSE2_LANES(a3, w3, d3);
        SSE2_MAX(m, w0);
        SSE2_MAX(m, w1);
        SSE2_MAX(m, w2);
        SSE2_MAX(m, w3);
    }
    uint32_t lanes[4];
    _mm_storeu_si128((__m128i *)lanes, _mm_xor_si128(m, bias));
    for (int l = 0; l < 4; l++) *mx = lanes[l] > *mx ? lanes[l] : *mx;
    _mm_storeu_si128((__m128i *)acc, a0);
    _mm_storeu_si128((__m128i *)(acc + 2), a1);
    _mm_storeu_si128((__m128i *)(acc + 4), a2);
    _mm_storeu_si128((__m128i *)(acc + 6), a3);
}
#endif

#if defined(HAVE_AVX2_PATH) && NATIVE_LANES
#define AVX2_LANES(a, w, d) \
    a = _mm256_add_epi64(a, _mm256_add_epi64(_mm256_mul_epu32(d, _mm256_srli_epi64(d, 32)), \
                                             _mm256_shuffle_epi32(w, 0x4E)))

/* The lane loop over ``nstripes`` whole stripes: lanes 0-3 in a0, 4-7 in a1, the running
 * unsigned max of the tokens in m (inlined where it is used: the registers stay registers). */
__attribute__((target("avx2"))) static inline void lanes_avx2(__m256i *a0, __m256i *a1,
                                                             __m256i *m, const unsigned char *p,
                                                             Py_ssize_t nstripes,
                                                             const uint64_t *kk) {
    for (Py_ssize_t j = 0; j < nstripes; j++, p += STRIPE, kk += 8) {
        PREFETCH(p + PREFETCH_AHEAD);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        __m256i d0 = _mm256_xor_si256(w0, _mm256_loadu_si256((const __m256i *)kk));
        __m256i d1 = _mm256_xor_si256(w1, _mm256_loadu_si256((const __m256i *)(kk + 4)));
        AVX2_LANES(*a0, w0, d0);
        AVX2_LANES(*a1, w1, d1);
        *m = _mm256_max_epu32(*m, _mm256_max_epu32(w0, w1));
    }
}

__attribute__((target("avx2"))) static inline uint32_t max_avx2(__m256i m, uint32_t mx) {
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, m);
    for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
    return mx;
}

__attribute__((target("avx2"))) static void absorb_avx2(uint64_t *acc, const unsigned char *p,
                                                         Py_ssize_t nstripes,
                                                         const uint64_t *kk, uint32_t *mx) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, m = _mm256_set1_epi32((int)*mx);
    lanes_avx2(&a0, &a1, &m, p, nstripes, kk);
    *mx = max_avx2(m, *mx);
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}
#endif

static const char *path_name = NULL;
static absorb_fn absorb_block = NULL;

/* Select a loop by name (NULL: the fastest this CPU runs); 0 if it is not available here. */
static int select_path(const char *name) {
#if defined(HAVE_AVX2_PATH) && NATIVE_LANES
    if ((name == NULL && __builtin_cpu_supports("avx2")) ||
        (name != NULL && strcmp(name, "avx2") == 0)) {
        if (!__builtin_cpu_supports("avx2")) return 0;
        absorb_block = absorb_avx2, path_name = "avx2";
        return 1;
    }
#endif
#if defined(__SSE2__) && NATIVE_LANES
    if (name == NULL || strcmp(name, "sse2") == 0) {
        absorb_block = absorb_sse2, path_name = "sse2";
        return 1;
    }
#endif
    if (name == NULL || strcmp(name, "scalar") == 0) {
        absorb_block = absorb_scalar, path_name = "scalar";
        return 1;
    }
    return 0;
}

static inline void finish(uint64_t *h0, uint64_t *h1, const uint64_t *acc, Py_ssize_t elen,
                          const uint64_t *K) {
    uint64_t u = fold(acc[0] ^ K[64], acc[1] ^ K[65]) + fold(acc[2] ^ K[66], acc[3] ^ K[67]);
    uint64_t v = fold(acc[4] ^ K[68], acc[5] ^ K[69]) + fold(acc[6] ^ K[70], acc[7] ^ K[71]);
    uint64_t x0 = *h0 ^ u ^ ((uint64_t)elen * P3), x1 = *h1 ^ v, lo, hi;
    mul128(x0 ^ K[72], x1 ^ K[73], &lo, &hi);
    *h0 = mix(lo + x1);
    *h1 = mix(hi + x0);
}

#if defined(HAVE_AVX2_PATH) && NATIVE_LANES
/* ``chain``'s loop for blocks of whole stripes without extras, on the AVX2 path: what
 * absorb_avx2 and finish compute block by block, in one loop with no call between blocks and
 * the running max kept in a register, so that a block's lanes and folds (which do not depend
 * on its parent) overlap its predecessor's finaliser (65,536 tokens: 31 -> 25 us here). */
__attribute__((target("avx2"))) static void chain_avx2(const unsigned char *src,
                                                      Py_ssize_t nblocks, Py_ssize_t whole,
                                                      const uint64_t *kk, const uint64_t *K,
                                                      uint64_t *h0, uint64_t *h1,
                                                      unsigned char *dst, uint32_t *mx) {
    __m256i m = _mm256_set1_epi32((int)*mx);
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        lanes_avx2(&a0, &a1, &m, src + b * whole * STRIPE, whole, kk);
        uint64_t acc[8];
        _mm256_storeu_si256((__m256i *)acc, a0);
        _mm256_storeu_si256((__m256i *)(acc + 4), a1);
        finish(h0, h1, acc, 0, K);
        wr64(dst + b * DIGEST, *h0);
        wr64(dst + b * DIGEST + 8, *h1);
    }
    *mx = max_avx2(m, *mx);
}
#endif

/* chain(parent, tokens, block_size, keys, extras, with_max=False) -> bytes, or with
 * ``with_max`` (bytes, the largest token id as unsigned 32-bit, over all the tokens).
 * parent: 16 bytes; tokens: a C-contiguous buffer of 4-byte items (little-endian int32);
 * keys: NKEYS * 8 bytes; extras: None or a sequence of (block index, bytes) in increasing
 * block order (indices relative to the first block of tokens). Returns the packed digests of
 * the len(tokens) // block_size full blocks. */
static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, tokens, keys;
    Py_ssize_t bs;
    PyObject *extras;
    int with_max = 0;
    uint32_t mx = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*ny*O|p", &parent, &tokens, &bs, &keys, &extras, &with_max))
        return NULL;
    PyObject *out = NULL, *seq = NULL;
    uint64_t *kk = NULL;
    if (parent.len != DIGEST || keys.len != NKEYS * 8 || bs <= 0 || tokens.itemsize != 4 ||
        tokens.len % 4) {
        PyErr_SetString(PyExc_ValueError,
                        "kvs128.chain: parent must be 16 bytes, keys 592, block_size > 0, "
                        "tokens 4-byte items");
        goto done;
    }
    if (extras != Py_None) {
        seq = PySequence_Fast(extras, "kvs128.chain: extras must be a sequence or None");
        if (seq == NULL) goto done;
    }
    uint64_t K[NKEYS];
    for (int i = 0; i < NKEYS; i++) K[i] = rd64((const unsigned char *)keys.buf + 8 * i);
    Py_ssize_t nblocks = tokens.len / 4 / bs, step = 4 * bs, whole = step / STRIPE;
    Py_ssize_t rest = step - whole * STRIPE;
    kk = PyMem_Malloc((size_t)(whole > 0 ? whole : 1) * 8 * sizeof(uint64_t));
    if (kk == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < whole * 8; i++) kk[i] = word_key(K, (uint64_t)i);

    out = PyBytes_FromStringAndSize(NULL, nblocks * DIGEST);
    if (out == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const unsigned char *src = (const unsigned char *)tokens.buf;
    uint64_t h0 = rd64((const unsigned char *)parent.buf);
    uint64_t h1 = rd64((const unsigned char *)parent.buf + 8);
    Py_ssize_t next = 0, nextras = seq ? PySequence_Fast_GET_SIZE(seq) : 0;
    Py_ssize_t next_block = -1;
    const char *ebuf = NULL;
    Py_ssize_t elen = 0;
    Py_ssize_t b0 = 0; /* blocks done by the fast loop; the loop below is the general one */
#if defined(HAVE_AVX2_PATH) && NATIVE_LANES
    if (absorb_block == absorb_avx2 && nextras == 0 && rest == 0) {
        chain_avx2(src, nblocks, whole, kk, K, &h0, &h1, dst, &mx);
        b0 = nblocks;
    }
#endif
    for (Py_ssize_t b = b0; b < nblocks; b++) {
        while (next_block < b && next < nextras) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, next++);
            PyObject *idx, *val;
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
                PyErr_SetString(PyExc_TypeError, "kvs128.chain: extras items are (int, bytes)");
                Py_CLEAR(out);
                goto done;
            }
            idx = PyTuple_GET_ITEM(item, 0);
            val = PyTuple_GET_ITEM(item, 1);
            next_block = PyLong_AsSsize_t(idx);
            if ((next_block == -1 && PyErr_Occurred()) ||
                PyBytes_AsStringAndSize(val, (char **)&ebuf, &elen) < 0) {
                Py_CLEAR(out);
                goto done;
            }
        }
        Py_ssize_t this_elen = next_block == b ? elen : 0;
        const unsigned char *data = src + b * step;
        uint64_t acc[8];
        absorb_block(acc, data, whole, kk, &mx);
        if (rest) absorb_tail(acc, data + whole * STRIPE, rest, K, (uint64_t)whole * 8);
        if (this_elen) absorb_tail(acc, (const unsigned char *)ebuf, this_elen, K, EXTRA_WORD0);
        finish(&h0, &h1, acc, this_elen, K);
        wr64(dst + b * DIGEST, h0);
        wr64(dst + b * DIGEST + 8, h1);
        if (rest) mx = max_scalar(data + whole * STRIPE, rest, mx);
    }
    if (with_max) {
        /* the tokens past the last full block */
        mx = max_scalar(src + nblocks * step, tokens.len - nblocks * step, mx);
        PyObject *pair = Py_BuildValue("(Nk)", out, (unsigned long)mx);
        out = pair;  /* (NULL if it failed: the packed bytes were released with it) */
    }
done:
    PyMem_Free(kk);
    Py_XDECREF(seq);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&keys);
    return out;
}

/* digest(parent, data, keys) -> 16 bytes: any bytes (a plan field), as a chain of 1 KiB
 * blocks from ``parent`` whose last block is zero-padded, the data's length folded into it
 * as the extra length (so padding never collides with data). */
static PyObject *digest(PyObject *self, PyObject *args) {
    Py_buffer parent, data, keys;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*", &parent, &data, &keys)) return NULL;
    PyObject *out = NULL;
    if (parent.len != DIGEST || keys.len != NKEYS * 8) {
        PyErr_SetString(PyExc_ValueError, "kvs128.digest: parent must be 16 bytes, keys 592");
        goto done;
    }
    uint64_t K[NKEYS], kk[FIELD_BLOCK / 8];
    for (int i = 0; i < NKEYS; i++) K[i] = rd64((const unsigned char *)keys.buf + 8 * i);
    for (int i = 0; i < FIELD_BLOCK / 8; i++) kk[i] = word_key(K, (uint64_t)i);
    uint64_t h0 = rd64((const unsigned char *)parent.buf);
    uint64_t h1 = rd64((const unsigned char *)parent.buf + 8);
    const unsigned char *src = (const unsigned char *)data.buf;
    Py_ssize_t n = data.len, whole = n / FIELD_BLOCK;
    uint64_t acc[8];
    uint32_t mx = 0;
    for (Py_ssize_t b = 0; b < whole; b++) {
        absorb_block(acc, src + b * FIELD_BLOCK, FIELD_BLOCK / STRIPE, kk, &mx);
        finish(&h0, &h1, acc, 0, K);
    }
    for (int l = 0; l < 8; l++) acc[l] = 0;
    absorb_tail(acc, src + whole * FIELD_BLOCK, n - whole * FIELD_BLOCK, K, 0);
    finish(&h0, &h1, acc, n + 1, K);
    out = PyBytes_FromStringAndSize(NULL, DIGEST);
    if (out != NULL) {
        wr64((unsigned char *)PyBytes_AS_STRING(out), h0);
        wr64((unsigned char *)PyBytes_AS_STRING(out) + 8, h1);
    }
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    PyBuffer_Release(&keys);
    return out;
}

static PyObject *use(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (!select_path(name)) {
        PyErr_Format(PyExc_ValueError, "kvs128: path %s is not available on this CPU", name);
        return NULL;
    }
    return PyUnicode_FromString(path_name);
}

static PyMethodDef methods[] = {
    {"digest", digest, METH_VARARGS,
     "digest(parent, data, keys) -> 16-byte kvs128 digest of any bytes (1 KiB blocks, the "
     "last zero-padded, the length folded in)"},
    {"use", use, METH_VARARGS,
     "use(path=None) -> the lane loop now used: 'avx2', 'sse2' or 'scalar' (None: the "
     "fastest this CPU runs; ValueError where the named one is not available)"},
    {"chain", chain, METH_VARARGS,
     "chain(parent, tokens, block_size, keys, extras, with_max=False) -> packed kvs128 "
     "digests of the full blocks (with_max: and the largest token id, as unsigned 32-bit)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvs128",
                                    "Native kernel of the kvs128 block identity.", -1, methods};

PyMODINIT_FUNC PyInit__kvs128(void) {
    select_path(NULL);
    return PyModule_Create(&module);
}
