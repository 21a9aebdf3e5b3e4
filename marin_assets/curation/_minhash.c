/* MinHash signatures of the "fast" mode in one pass per document (marin_assets/curation/minhash.py).
 *
 * The numpy implementation in minhash.py is the definition; this computes the same signatures bit
 * for bit (tests/curation/test_minhash.py compares them) at a fraction of the CPU: the token
 * hashes, the shingle hashes and the 128 permutations of each shingle stay in registers instead of
 * going through shard-sized numpy temporaries. Plain C API and the buffer protocol, so it builds
 * without numpy's headers; target_clones picks AVX-512, AVX2 or baseline code at load time, so one
 * build runs on any x86-64.
 */
#include "_kernel_buffers.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MARIN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MARIN_CLONES
#endif

static inline uint64_t fmix64(uint64_t v) {
    v ^= v >> 33;
    v *= 0xFF51AFD7ED558CCDULL;
    v ^= v >> 33;
    v *= 0xC4CEB9FE1A85EC53ULL;
    v ^= v >> 33;
    return v;
}

static inline uint32_t fmix32(uint32_t v) {
    v ^= v >> 16;
    v *= 0x85EBCA6BU;
    v ^= v >> 13;
    v *= 0xC2B2AE35U;
    v ^= v >> 16;
    return v;
}

/* [0-9A-Za-z_] or >= 0x80, as minhash._is_word_byte. */
static inline int is_word_byte(uint8_t c) {
    return c >= 0x80 || (uint8_t)(c - '0') < 10 || (uint8_t)((c | 0x20) - 'a') < 26 || c == '_';
}

static inline void permute_min(uint32_t hash32, const uint32_t *a, const uint32_t *b, uint32_t *sig, Py_ssize_t num_perm) {
    uint32_t mixed = fmix32(hash32);
    for (Py_ssize_t k = 0; k < num_perm; k++) {
        uint32_t v = a[k] * mixed + b[k];
        sig[k] = v < sig[k] ? v : sig[k];
    }
}

/* 0, or -1 when memory for a document's token hashes could not be had. Cloned per instruction set
 * as a whole, so the permutation loop is inlined and vectorised in each clone. */
MARIN_CLONES
static int sign_documents(const uint8_t *bytes, const int64_t *doc_ends, Py_ssize_t num_docs, Py_ssize_t shingle_size,
                          const uint64_t *multipliers, uint64_t base, const uint32_t *a, const uint32_t *b,
                          Py_ssize_t num_perm, uint32_t *out) {
    uint64_t *tokens = NULL;
    Py_ssize_t capacity = 0;
    for (Py_ssize_t d = 0; d < num_docs; d++) {
        int64_t pos = d == 0 ? 0 : doc_ends[d - 1] + 1, end = doc_ends[d];
        Py_ssize_t n = 0;
        while (pos < end) {
            while (pos < end && !is_word_byte(bytes[pos])) pos++;
            if (pos >= end) break;
            uint64_t poly = 0, power = 1;
            while (pos < end && is_word_byte(bytes[pos])) {
                poly += (uint64_t)bytes[pos] * power;
                power *= base;
                pos++;
            }
            if (n == capacity) {
                Py_ssize_t grown = capacity ? 2 * capacity : 4096;
                uint64_t *bigger = realloc(tokens, grown * sizeof(uint64_t));
                if (!bigger) {
                    free(tokens);
                    return -1;
                }
                tokens = bigger;
                capacity = grown;
            }
            tokens[n++] = fmix64(poly);
        }
        uint32_t *sig = out + d * num_perm;
        if (n == 0) continue;
        if (n < shingle_size) { /* one shingle of all its tokens */
            uint64_t h = 0;
            for (Py_ssize_t j = 0; j < n; j++) h += tokens[j] * multipliers[j];
            permute_min((uint32_t)(h >> 32), a, b, sig, num_perm);
            continue;
        }
        for (Py_ssize_t i = 0; i + shingle_size <= n; i++) {
            uint64_t h = 0;
            for (Py_ssize_t j = 0; j < shingle_size; j++) h += tokens[i + j] * multipliers[j];
            permute_min((uint32_t)(h >> 32), a, b, sig, num_perm);
        }
    }
    free(tokens);
    return 0;
}

/* signatures(data, doc_ends, shingle_size, a, b, multipliers, base, out)
 *   data: bytes of the lower-cased, UTF-8 encoded texts, each followed by one non-word byte
 *   doc_ends: int64 end offset of each text in data (exclusive, before its separator)
 *   a, b: uint32 permutation parameters (num_perm each)
 *   multipliers: uint64 SHINGLE_POSITION_MULTIPLIERS[:shingle_size]
 *   base: the polynomial token hash's base
 *   out: uint32 (len(doc_ends), num_perm), filled with 2**32 - 1 by the caller
 */
static PyObject *signatures(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[6];
    Py_ssize_t shingle_size;
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "OOnOOOKO", &objs[0], &objs[1], &shingle_size, &objs[2], &objs[3], &objs[4], &base,
                          &objs[5]))
        return NULL;
    static const Py_ssize_t itemsizes[6] = {1, 8, 4, 4, 8, 4};
    static const char *names[6] = {"data", "doc_ends", "a", "b", "multipliers", "out"};
    Py_buffer views[6];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if (get_buffer(objs[got], &views[got], itemsizes[got], got == 5, names[got]) < 0) goto done;
    Py_buffer *data = &views[0], *ends = &views[1], *a = &views[2], *b = &views[3], *mult = &views[4], *out = &views[5];

    Py_ssize_t num_docs = ends->len / 8, num_perm = a->len / 4;
    if (b->len / 4 != num_perm || out->len / 4 != num_docs * num_perm || shingle_size < 1 ||
        mult->len / 8 < shingle_size) {
        PyErr_SetString(PyExc_ValueError, "signatures: inconsistent array sizes");
        goto done;
    }
    const int64_t *doc_ends = ends->buf;
    for (Py_ssize_t d = 0; d < num_docs; d++) {
        int64_t start = d == 0 ? 0 : doc_ends[d - 1] + 1, end = doc_ends[d];
        if (start < 0 || end < start || end > data->len) {
            PyErr_SetString(PyExc_ValueError, "signatures: doc_ends out of range");
            goto done;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = sign_documents(data->buf, doc_ends, num_docs, shingle_size, mult->buf, base, a->buf, b->buf, num_perm,
                            out->buf);
    Py_END_ALLOW_THREADS
    if (status < 0)
        PyErr_NoMemory();
    else
        result = Py_NewRef(Py_None);

done:
    for (int i = got; i > 0; i--) PyBuffer_Release(&views[i - 1]);
    return result;
}

static PyMethodDef methods[] = {
    {"signatures", signatures, METH_VARARGS, "MinHash signatures of the fast mode, written into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_minhash", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__minhash(void) { return PyModule_Create(&module); }
