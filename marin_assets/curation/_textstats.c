/* The regex counts behind filters.text_stats, for a list of str, in one pass per text.
 *
 * The patterns in marin_assets/curation/filters.py are the definition (polars' regex engine counts
 * them where this kernel was not built); tests/curation/test_filters.py compares the two on text
 * mixing every character class. Each character is classified once through `classes`, the table
 * filters._CHAR_CLASSES that polars' own regex engine filled in, so \s, \w, \p{L} and [\p{P}\p{S}]
 * mean here what they mean there. The texts are read in CPython's own storage (1, 2 or 4 bytes per
 * character): nothing is encoded or copied. `duplicate_chars` gives the characters in repeated
 * lines and paragraphs behind filters._duplicate_fractions, the same way.
 */
#include "_kernel_buffers.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* filters._CHAR_CLASSES flags. */
enum { SPACE = 1, LETTER = 2, PUNCT_OR_SYMBOL = 4, KNOWN = 8, WORD = 16 };

/* Columns of the output, per text (filters._TEXT_COUNT_COLUMNS names them). */
enum {
    WORDS,          /* \S+ */
    NONSPACE,       /* \S */
    WORD_CORES,     /* WORD_CORE_PATTERN: per word, first to last character not \s, \p{P} or \p{S} */
    NON_CORE_CHARS, /* \S left once the cores are removed */
    ALPHA_WORDS,    /* ALPHA_WORD_PATTERN: words with a letter */
    LINES,          /* NONEMPTY_LINE_PATTERN */
    SYMBOLS,        /* SYMBOL_PATTERN: '#', '...' (a run of k dots holds k / 3), U+2026 */
    BULLET_LINES,   /* BULLET_LINE_PATTERN */
    ELLIPSIS_LINES, /* ELLIPSIS_LINE_PATTERN */
    STOP_WORDS,     /* STOP_WORD_PATTERN: a whole \w run equal to a stop word, ASCII case folded */
    N_COLUMNS
};

#define ELLIPSIS 0x2026u

static int is_bullet(uint32_t c) {
    switch (c) {
        case 0x2022: case 0x2023: case 0x25E6: case 0x25AA: case 0x25AB: case 0x25CF: case 0x25CB:
        case 0x25A0: case 0x25A1: case 0x2013: case 0x2014: case '*': case '-': case '+':
            return 1;
        default:
            return 0;
    }
}

/* A \w run of 2 to 4 ASCII letters, lower-cased into one word: is it a stop word? The regex is
 * case-insensitive by Unicode simple case folding, under which no character outside ASCII folds to
 * a letter of these words (test_stop_word_letters_fold_only_from_ascii checks that). */
static int is_stop_word(uint32_t packed, int length) {
#define W2(a, b) ((uint32_t)(a) | (uint32_t)(b) << 8)
#define W3(a, b, c) (W2(a, b) | (uint32_t)(c) << 16)
#define W4(a, b, c, d) (W3(a, b, c) | (uint32_t)(d) << 24)
    switch (length) {
        case 2: return packed == W2('b', 'e') || packed == W2('t', 'o') || packed == W2('o', 'f');
        case 3: return packed == W3('t', 'h', 'e') || packed == W3('a', 'n', 'd');
        case 4: return packed == W4('t', 'h', 'a', 't') || packed == W4('h', 'a', 'v', 'e') ||
                       packed == W4('w', 'i', 't', 'h');
        default: return 0;
    }
#undef W4
#undef W3
#undef W2
}

static inline __attribute__((always_inline)) uint32_t char_at(const void *data, int kind, Py_ssize_t i) {
    return kind == PyUnicode_1BYTE_KIND ? ((const uint8_t *)data)[i]
           : kind == PyUnicode_2BYTE_KIND ? ((const uint16_t *)data)[i]
                                          : ((const uint32_t *)data)[i];
}

/* The counts of one text into `out` (N_COLUMNS entries). Inlined per storage kind, so that
 * char_at's branch on the kind folds away. */
static inline __attribute__((always_inline)) void count_text(const void *data, int kind, Py_ssize_t length,
                                                             const uint8_t *classes, int64_t *out) {
    int64_t counts[N_COLUMNS] = {0};
    /* The current \S run (a word): its length, first and last core position in it, a letter seen. */
    Py_ssize_t run = 0, first_core = -1, last_core = -1;
    int letter = 0;
    /* The current \w run: its length and its first 4 characters, lower-cased, while all ASCII letters. */
    Py_ssize_t word_run = 0;
    uint32_t word_packed = 0;
    int word_ascii = 1;
    /* The line: still in its leading [ \t]; dots ending its last non-[ \t] character; that
     * character was U+2026. */
    int leading = 1, line_dots = 0, line_ellipsis = 0;
    Py_ssize_t dots = 0; /* the current run of '.', for SYMBOLS */
    for (Py_ssize_t i = 0; i <= length; i++) {
        /* Past the end acts as a newline: it ends the word, the line and every run. */
        uint32_t c = i < length ? char_at(data, kind, i) : '\n';
        uint8_t cls = i < length ? classes[c] : SPACE;
        if (cls & SPACE) {
            if (run) {
                if (first_core >= 0) {
                    counts[WORD_CORES]++;
                    counts[NON_CORE_CHARS] += run - (last_core - first_core + 1);
                } else {
                    counts[NON_CORE_CHARS] += run;
                }
                counts[ALPHA_WORDS] += letter;
                run = 0, first_core = last_core = -1, letter = 0;
            }
        } else {
            if (run == 0) counts[WORDS]++;
            counts[NONSPACE]++;
            if (!(cls & PUNCT_OR_SYMBOL)) {
                if (first_core < 0) first_core = run;
                last_core = run;
            }
            letter |= (cls & LETTER) != 0;
            run++;
        }
        if (cls & WORD) {
            if (word_run < 4) {
                uint32_t lower = c | 0x20;
                word_ascii &= c < 128 && lower >= 'a' && lower <= 'z';
                word_packed |= (lower & 0xFF) << (8 * word_run);
            }
            word_run++;
        } else if (word_run) {
            counts[STOP_WORDS] += word_ascii && word_run <= 4 && is_stop_word(word_packed, (int)word_run);
            word_run = 0, word_packed = 0, word_ascii = 1;
        }
        if (c == '.') {
            dots++;
        } else if (dots) {
            counts[SYMBOLS] += dots / 3;
            dots = 0;
        }
        counts[SYMBOLS] += c == '#' || c == ELLIPSIS;
        if (c == '\n') {
            counts[ELLIPSIS_LINES] += line_dots >= 3 || line_ellipsis;
            leading = 1, line_dots = 0, line_ellipsis = 0;
            continue;
        }
        if (c == ' ' || c == '\t') continue; /* leading or trailing blanks change nothing */
        if (leading) {
            leading = 0;
            counts[LINES] += !(cls & SPACE);
            if (is_bullet(c)) {
                uint32_t next = i + 1 < length ? char_at(data, kind, i + 1) : '\n';
                counts[BULLET_LINES] += next == ' ' || next == '\t' || next == '\n';
            }
        }
        /* A dot continues the line's dots only right after another dot (no blank between). */
        line_dots = c == '.' ? (i > 0 && char_at(data, kind, i - 1) == '.' ? line_dots + 1 : 1) : 0;
        line_ellipsis = c == ELLIPSIS;
    }
    memcpy(out, counts, sizeof(counts));
}

/* 1 if every character of every text has a known class, 0 if not, -1 (TypeError set) if an item
 * of `texts` is not a str. A text of only ASCII is known: filters learns the first 0x3000 code
 * points on import. */
static int classes_known(PyObject *texts, const uint8_t *table) {
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(texts); t++) {
        PyObject *text = PyList_GET_ITEM(texts, t);
        if (!PyUnicode_Check(text)) {
            PyErr_Format(PyExc_TypeError, "texts[%zd] is not a str", t);
            return -1;
        }
        if (PyUnicode_IS_ASCII(text)) continue;
        const void *data = PyUnicode_DATA(text);
        int kind = PyUnicode_KIND(text);
        for (Py_ssize_t i = 0, length = PyUnicode_GET_LENGTH(text); i < length; i++)
            if (!(table[char_at(data, kind, i)] & KNOWN)) return 0;
    }
    return 1;
}

/* A piece of a text (a line or a paragraph, stripped of \s at both ends), by its hash. */
typedef struct {
    uint64_t hash;
    Py_ssize_t start, length; /* in characters */
} Piece;

typedef struct {
    Piece *pieces;
    Py_ssize_t size, capacity;
    int32_t *slots; /* open addressing over `pieces`: index, or -1 */
    Py_ssize_t n_slots;
} Pieces;

static uint64_t hash_bytes(const uint8_t *p, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    uint64_t word = 0;
    memcpy(&word, p, (size_t)n);
    h = (h ^ word) * 0x94D049BB133111EBull;
    return h ^ (h >> 29);
}

/* Add characters [start, end) of the text, stripped of \s, as a piece (nothing if empty). */
static inline __attribute__((always_inline)) int add_piece(Pieces *ps, const void *data, int kind, Py_ssize_t start,
                                                           Py_ssize_t end, const uint8_t *classes) {
    while (start < end && (classes[char_at(data, kind, start)] & SPACE)) start++;
    while (end > start && (classes[char_at(data, kind, end - 1)] & SPACE)) end--;
    if (start == end) return 0;
    if (ps->size == ps->capacity) {
        Py_ssize_t grown = ps->capacity ? 2 * ps->capacity : 1024;
        Piece *pieces = realloc(ps->pieces, grown * sizeof(Piece));
        if (!pieces) return -1;
        ps->pieces = pieces, ps->capacity = grown;
    }
    Piece *piece = &ps->pieces[ps->size++];
    piece->start = start, piece->length = end - start;
    piece->hash = hash_bytes((const uint8_t *)data + start * kind, (end - start) * kind);
    return 0;
}

/* Characters in all of the text's pieces, and in the pieces equal to an earlier one. */
static int repeated_chars(Pieces *ps, const void *data, int kind, int64_t *duplicated, int64_t *total) {
    *duplicated = *total = 0;
    Py_ssize_t wanted = 16;
    while (wanted < 2 * ps->size) wanted *= 2;
    if (wanted > ps->n_slots) {
        int32_t *slots = realloc(ps->slots, wanted * sizeof(int32_t));
        if (!slots) return -1;
        ps->slots = slots, ps->n_slots = wanted;
    }
    memset(ps->slots, 0xFF, wanted * sizeof(int32_t));
    const uint8_t *bytes = data;
    for (Py_ssize_t i = 0; i < ps->size; i++) {
        const Piece *piece = &ps->pieces[i];
        *total += piece->length;
        for (Py_ssize_t slot = (Py_ssize_t)(piece->hash & (uint64_t)(wanted - 1));; slot = (slot + 1) & (wanted - 1)) {
            int32_t j = ps->slots[slot];
            if (j < 0) {
                ps->slots[slot] = (int32_t)i;
                break;
            }
            const Piece *seen = &ps->pieces[j];
            if (seen->hash == piece->hash && seen->length == piece->length &&
                memcmp(bytes + seen->start * kind, bytes + piece->start * kind, piece->length * kind) == 0) {
                *duplicated += piece->length;
                break;
            }
        }
    }
    return 0;
}

/* Lines: split at '\n'. Paragraphs: split at each PARAGRAPH_BREAK_PATTERN match (\n[ \t]*\n\s*,
 * leftmost first, not overlapping) and at each NUL (filters marks the breaks with NUL, then
 * splits at NULs). Writes line duplicated, line total, paragraph duplicated, paragraph total. */
static inline __attribute__((always_inline)) int duplicates_of_text(Pieces *ps, const void *data, int kind,
                                                                    Py_ssize_t length, const uint8_t *classes,
                                                                    int64_t *out) {
    ps->size = 0;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i <= length; i++) {
        if (i == length || char_at(data, kind, i) == '\n') {
            if (add_piece(ps, data, kind, start, i, classes) < 0) return -1;
            start = i + 1;
        }
    }
    if (repeated_chars(ps, data, kind, &out[0], &out[1]) < 0) return -1;
    ps->size = 0;
    start = 0;
    for (Py_ssize_t i = 0; i < length;) {
        uint32_t c = char_at(data, kind, i);
        Py_ssize_t next = i + 1; /* where the next piece starts, if i ends one */
        if (c == '\n') {
            Py_ssize_t j = i + 1;
            while (j < length && (char_at(data, kind, j) == ' ' || char_at(data, kind, j) == '\t')) j++;
            if (j < length && char_at(data, kind, j) == '\n') {
                for (j++; j < length && (classes[char_at(data, kind, j)] & SPACE); j++) {
                }
                next = j;
            } else {
                i++;
                continue;
            }
        } else if (c != 0) {
            i++;
            continue;
        }
        if (add_piece(ps, data, kind, start, i, classes) < 0) return -1;
        start = i = next;
    }
    if (add_piece(ps, data, kind, start, length, classes) < 0) return -1;
    return repeated_chars(ps, data, kind, &out[2], &out[3]);
}

/* Calls `per_text(state, text, classes, row)` for each text of `texts` with its row of `columns`
 * int64 in `out`: the argument handling of text_counts and duplicate_chars below. Returns True,
 * False when some character's class is not known yet (nothing is counted), or NULL with an error
 * set (MemoryError when `per_text` returns -1). */
typedef int (*PerText)(void *state, PyObject *text, const uint8_t *classes, int64_t *row);

static PyObject *for_each_text(PyObject *args, const char *name, Py_ssize_t columns, PerText per_text, void *state) {
    PyObject *texts, *classes_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "O!OO", &PyList_Type, &texts, &classes_obj, &out_obj)) return NULL;
    Py_buffer classes, out;
    if (get_buffer(classes_obj, &classes, 1, 0, "classes") < 0) return NULL;
    if (get_buffer(out_obj, &out, 8, 1, "out") < 0) {
        PyBuffer_Release(&classes);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(texts);
    if (classes.len != 0x110000 || out.len != n * columns * 8) {
        PyErr_Format(PyExc_ValueError, "%s: classes needs 0x110000 entries and out len(texts) * %zd", name, columns);
        goto done;
    }
    int known = classes_known(texts, classes.buf);
    if (known <= 0) {
        if (known == 0) result = Py_NewRef(Py_False);
        goto done;
    }
    for (Py_ssize_t t = 0; t < n; t++) {
        if (per_text(state, PyList_GET_ITEM(texts, t), classes.buf, (int64_t *)out.buf + t * columns) < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    result = Py_NewRef(Py_True);

done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&classes);
    return result;
}

/* The text's storage kind as a constant in each call, so that char_at's branch folds away. */
#define BY_KIND(text, call_with_kind)                                                     \
    switch (PyUnicode_KIND(text)) {                                                       \
        case PyUnicode_1BYTE_KIND: call_with_kind(PyUnicode_1BYTE_KIND); break;           \
        case PyUnicode_2BYTE_KIND: call_with_kind(PyUnicode_2BYTE_KIND); break;           \
        default: call_with_kind(PyUnicode_4BYTE_KIND); break;                             \
    }

static int counts_of(void *Py_UNUSED(state), PyObject *text, const uint8_t *classes, int64_t *row) {
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
#define COUNT(kind) count_text(data, kind, length, classes, row)
    BY_KIND(text, COUNT)
#undef COUNT
    return 0;
}

static int duplicates_of(void *pieces, PyObject *text, const uint8_t *classes, int64_t *row) {
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    int status = 0;
#define DUPLICATES(kind) status = duplicates_of_text(pieces, data, kind, length, classes, row)
    BY_KIND(text, DUPLICATES)
#undef DUPLICATES
    return status;
}

/* text_counts(texts, classes, out)
 *   texts: a list of str; classes: uint8, 0x110000 entries (filters._CHAR_CLASSES);
 *   out: int64, len(texts) * N_COLUMNS, written row by row
 * Returns True, or False when some character's class is not known yet (no KNOWN flag): then nothing
 * is counted, and the caller learns the classes and calls again. */
static PyObject *text_counts(PyObject *Py_UNUSED(self), PyObject *args) {
    return for_each_text(args, "text_counts", N_COLUMNS, counts_of, NULL);
}

/* duplicate_chars(texts, classes, out)
 *   texts, classes: as text_counts'; out: int64, len(texts) * 4, written row by row: characters in
 *   repeated lines, in all lines, in repeated paragraphs, in all paragraphs (a piece repeats when it
 *   equals an earlier piece of the same text; pieces are stripped of \s and empty ones left out)
 * Returns True, or False when some character's class is not known yet (nothing is counted). */
static PyObject *duplicate_chars(PyObject *Py_UNUSED(self), PyObject *args) {
    Pieces pieces = {NULL, 0, 0, NULL, 0};
    PyObject *result = for_each_text(args, "duplicate_chars", 4, duplicates_of, &pieces);
    free(pieces.pieces);
    free(pieces.slots);
    return result;
}

static PyMethodDef methods[] = {
    {"text_counts", text_counts, METH_VARARGS, "filters.text_stats' regex counts of a list of str."},
    {"duplicate_chars", duplicate_chars, METH_VARARGS, "Characters in repeated lines and paragraphs of a list of str."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_textstats", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__textstats(void) { return PyModule_Create(&module); }
