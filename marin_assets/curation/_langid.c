/* langid.py's feature counts of a batch of texts, as a CSR matrix (marin_assets/curation/filters.py).
 *
 * `language_id._feature_hits` with `_language_feature_counts` is the definition: every 1- to 4-byte
 * n-gram of each text's UTF-8 bytes is looked up in the same feature tables, and the hits are summed
 * per (text, feature). Here that is one pass per text with a per-text counter instead of numpy arrays
 * of every position and a sort of every hit; tests/curation/test_filters.py compares the two.
 * Plain C API and the buffer protocol, so it builds without numpy's headers.
 */
#include "_kernel_buffers.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    /* language_id._FeatureTables.kernel: `two` answers the 2-byte lookup and picks the row of `three`
     * for the third byte, whose entry answers the 3-byte lookup and picks the row of `four` for
     * the fourth byte. Row 0 of `three` and of `four` is zeros. */
    const uint16_t *one, *four;
    const uint32_t *two, *three;
    Py_ssize_t n_features;
} Tables;

typedef struct {
    int32_t *indices, *counts;
    Py_ssize_t size, capacity;
} Entries;

static int entries_push(Entries *e, int32_t index, int32_t count) {
    if (e->size == e->capacity) {
        Py_ssize_t grown = e->capacity ? 2 * e->capacity : 65536;
        int32_t *indices = realloc(e->indices, grown * sizeof(int32_t));
        if (!indices) return -1;
        e->indices = indices;
        int32_t *counts = realloc(e->counts, grown * sizeof(int32_t));
        if (!counts) return -1;
        e->counts = counts;
        e->capacity = grown;
    }
    e->indices[e->size] = index;
    e->counts[e->size] = count;
    e->size++;
    return 0;
}

/* Counter slots before the features': misses of the 3- and 4-byte lookups are counted in them
 * rather than branched on (a hit is a coin toss there, so a branch would mispredict often), spread
 * over 8 slots per order so that no single counter's increments form one long dependency chain. */
#define JUNK_SLOTS 16

/* Count one text's features into `counts` (JUNK_SLOTS + n_features entries, zero on entry), setting
 * each touched slot's bit in `touched` (a bitmap, zero on entry). A table entry is the feature
 * index + 1, or 0. */
static void count_text(const uint8_t *text, Py_ssize_t length, const Tables *t, int32_t *counts,
                       uint64_t *touched) {
#define COUNT(slot_expr)                                                           \
    do {                                                                           \
        int32_t slot = (slot_expr);                                                \
        if (counts[slot]++ == 0) touched[slot >> 6] |= (uint64_t)1 << (slot & 63); \
    } while (0)
    for (Py_ssize_t p = 0; p < length; p++) {
        int32_t junk = (int32_t)(p & 7);
        uint32_t entry = t->one[text[p]];
        if (entry) COUNT((int32_t)entry + JUNK_SLOTS - 1); /* 1- and 2-byte features are rare: a branch */
        if (p + 1 >= length) continue;
        uint32_t two = t->two[(uint32_t)text[p] << 8 | text[p + 1]];
        entry = two & 0xFFFF;
        if (entry) COUNT((int32_t)entry + JUNK_SLOTS - 1);
        if (p + 2 >= length) continue;
        uint32_t three = t->three[(Py_ssize_t)(two >> 16) * 256 + text[p + 2]];
        entry = three >> 16;
        COUNT(entry ? (int32_t)entry + JUNK_SLOTS - 1 : junk);
        if (p + 3 >= length) continue;
        entry = t->four[(Py_ssize_t)(three & 0xFFFF) * 256 + text[p + 3]];
        COUNT(entry ? (int32_t)entry + JUNK_SLOTS - 1 : 8 + junk);
    }
#undef COUNT
}

static int batch_counts(const uint8_t *data, const int64_t *starts, Py_ssize_t n_texts, const Tables *t,
                        int64_t *indptr, Entries *out) {
    Py_ssize_t slots = JUNK_SLOTS + t->n_features, words = (slots + 63) / 64;
    int32_t *counts = calloc(slots, sizeof(int32_t));
    uint64_t *touched = calloc(words, sizeof(uint64_t));
    int status = 0;
    if (!counts || !touched) status = -1;
    indptr[0] = 0;
    for (Py_ssize_t i = 0; i < n_texts && status == 0; i++) {
        count_text(data + starts[i], starts[i + 1] - starts[i], t, counts, touched);
        /* The bitmap gives the touched slots in ascending order: CSR rows need sorted columns. */
        for (Py_ssize_t w = 0; w < words && status == 0; w++) {
            for (uint64_t bits = touched[w]; bits; bits &= bits - 1) {
                int32_t slot = (int32_t)(w * 64 + __builtin_ctzll(bits));
                if (slot >= JUNK_SLOTS && entries_push(out, slot - JUNK_SLOTS, counts[slot]) < 0) {
                    status = -1;
                    break;
                }
                counts[slot] = 0;
            }
            touched[w] = 0;
        }
        indptr[i + 1] = out->size;
    }
    free(counts);
    free(touched);
    return status;
}

/* Whether every entry of the tables is in range: a feature index + 1 at most n_features, a row
 * of `three` or `four` that exists. The tables are small (about 2 MB), so this costs little. */
static int tables_in_range(const Tables *t, Py_ssize_t three_rows, Py_ssize_t four_rows) {
    for (Py_ssize_t i = 0; i < 256; i++)
        if (t->one[i] > t->n_features) return 0;
    for (Py_ssize_t i = 0; i < 65536; i++)
        if ((t->two[i] & 0xFFFF) > t->n_features || (t->two[i] >> 16) >= three_rows) return 0;
    for (Py_ssize_t i = 0; i < three_rows * 256; i++)
        if ((t->three[i] >> 16) > t->n_features || (t->three[i] & 0xFFFF) >= four_rows) return 0;
    for (Py_ssize_t i = 0; i < four_rows * 256; i++)
        if (t->four[i] > t->n_features) return 0;
    for (Py_ssize_t i = 0; i < 256; i++)
        if (t->three[i] || t->four[i]) return 0; /* row 0 of each: zeros */
    return 1;
}

/* feature_counts(data, starts, one, two, three, four, n_features, indptr)
 *   data: the texts' bytes back to back; starts: int64, len(texts) + 1 offsets into data;
 *   one: uint16, 256 entries; two: uint32, 65536; three: uint32 and four: uint16, rows of 256
 *   (see Tables); indptr: int64 out
 * Returns (indices, counts): bytes of int32 each, the CSR column indices (ascending per row) and
 * values. */
static PyObject *feature_counts(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *objs[6], *indptr_obj;
    Py_ssize_t n_features;
    if (!PyArg_ParseTuple(args, "OOOOOOnO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &n_features,
                          &indptr_obj))
        return NULL;
    static const Py_ssize_t itemsizes[6] = {1, 8, 2, 4, 4, 2};
    static const char *names[6] = {"data", "starts", "one", "two", "three", "four"};
    Py_buffer views[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if (get_buffer(objs[got], &views[got], itemsizes[got], 0, names[got]) < 0) goto done;
    if (get_buffer(indptr_obj, &views[6], 8, 1, "indptr") < 0) goto done;
    got = 7;

    Py_ssize_t n_texts = views[1].len / 8 - 1;
    const int64_t *starts = views[1].buf;
    if (n_texts < 0 || views[6].len / 8 != n_texts + 1 || views[2].len != 256 * 2 || views[3].len != 65536 * 4 ||
        views[4].len % 1024 || views[4].len == 0 || views[5].len % 512 || views[5].len == 0 || n_features < 1 ||
        n_features > 65535) {
        PyErr_SetString(PyExc_ValueError, "feature_counts: inconsistent table or array sizes");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_texts; i++) {
        if (starts[i] < 0 || starts[i + 1] < starts[i] || starts[i + 1] > views[0].len) {
            PyErr_SetString(PyExc_ValueError, "feature_counts: starts out of range");
            goto done;
        }
    }
    Tables tables = {views[2].buf, views[5].buf, views[3].buf, views[4].buf, n_features};
    if (!tables_in_range(&tables, views[4].len / 1024, views[5].len / 512)) {
        PyErr_SetString(PyExc_ValueError, "feature_counts: a table entry is out of range");
        goto done;
    }
    Entries entries = {NULL, NULL, 0, 0};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = batch_counts(views[0].buf, starts, n_texts, &tables, views[6].buf, &entries);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
    } else {
        /* y# makes None of a NULL pointer: no entries at all is two empty bytes objects. */
        result = Py_BuildValue("(y#y#)", entries.size ? (const char *)entries.indices : "",
                               entries.size * (Py_ssize_t)sizeof(int32_t),
                               entries.size ? (const char *)entries.counts : "",
                               entries.size * (Py_ssize_t)sizeof(int32_t));
    }
    free(entries.indices);
    free(entries.counts);

done:
    for (int i = got; i > 0; i--) PyBuffer_Release(&views[i - 1]);
    return result;
}

static PyMethodDef methods[] = {
    {"feature_counts", feature_counts, METH_VARARGS, "langid feature counts of a batch of texts, as CSR parts."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_langid", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__langid(void) { return PyModule_Create(&module); }
