/* The regex counts behind filters.text_stats, for a list of str, in one pass per text.
 *
 * The patterns in marin_assets/curation/filters.py are the definition (polars' regex engine counts
 * them where this kernel was not built); tests/curation/test_filters.py compares the two on text
 * mixing every character class. Each character is classified once through `classes`, the table
 * filters._CHAR_CLASSES that polars' own regex engine filled in, so \s, \w, \p{L} and [\p{P}\p{S}]
 * mean here what they mean there. The texts are read in CPython's own storage (1, 2 or 4 bytes per
 * character): nothing is encoded or copied.
 */
#include "_kernel_buffers.h"
#include <stdint.h>
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
static inline __attribute__((always_inline)) void count_text(const void *data, int kind, Py_ssize_t length, const uint8_t *classes, int64_t *out) {
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

/* text_counts(texts, classes, out)
 *   texts: a list of str; classes: uint8, 0x110000 entries (filters._CHAR_CLASSES);
 *   out: int64, len(texts) * N_COLUMNS, written row by row
 * Returns True, or False when some character's class is not known yet (no KNOWN flag): then nothing
 * is counted, and the caller learns the classes and calls again. */
static PyObject *text_counts(PyObject *Py_UNUSED(self), PyObject *args) {
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
    if (classes.len != 0x110000 || out.len != n * N_COLUMNS * 8) {
        PyErr_SetString(PyExc_ValueError, "text_counts: classes needs 0x110000 entries and out len(texts) * 10");
        goto done;
    }
    const uint8_t *table = classes.buf;
    /* First every character's class must be known; a text of only ASCII (max char < 128) is
     * (filters learns the first 0x3000 code points on import). */
    for (Py_ssize_t t = 0; t < n; t++) {
        PyObject *text = PyList_GET_ITEM(texts, t);
        if (!PyUnicode_Check(text)) {
            PyErr_Format(PyExc_TypeError, "text_counts: texts[%zd] is not a str", t);
            goto done;
        }
        if (PyUnicode_IS_ASCII(text)) continue;
        const void *data = PyUnicode_DATA(text);
        int kind = PyUnicode_KIND(text);
        Py_ssize_t length = PyUnicode_GET_LENGTH(text);
        for (Py_ssize_t i = 0; i < length; i++) {
            uint32_t c = char_at(data, kind, i);
            if (!(table[c] & KNOWN)) {
                result = Py_NewRef(Py_False);
                goto done;
            }
        }
    }
    int64_t *rows = out.buf;
    for (Py_ssize_t t = 0; t < n; t++) {
        PyObject *text = PyList_GET_ITEM(texts, t);
        const void *data = PyUnicode_DATA(text);
        Py_ssize_t length = PyUnicode_GET_LENGTH(text);
        switch (PyUnicode_KIND(text)) {
            case PyUnicode_1BYTE_KIND: count_text(data, PyUnicode_1BYTE_KIND, length, table, rows + t * N_COLUMNS); break;
            case PyUnicode_2BYTE_KIND: count_text(data, PyUnicode_2BYTE_KIND, length, table, rows + t * N_COLUMNS); break;
            default: count_text(data, PyUnicode_4BYTE_KIND, length, table, rows + t * N_COLUMNS); break;
        }
    }
    result = Py_NewRef(Py_True);

done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&classes);
    return result;
}

static PyMethodDef methods[] = {
    {"text_counts", text_counts, METH_VARARGS, "filters.text_stats' regex counts of a list of str."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_textstats", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__textstats(void) { return PyModule_Create(&module); }
