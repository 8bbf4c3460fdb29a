/* The Python attribute names an extension reads or calls, in one table: interned once at
 * import (the C code then uses the interned objects) and exposed as the module's `NAMES`, a
 * tuple of str. sidecar/proxy/native.py declares whose attribute each name is, and
 * tests/proxy/test_native_build.py checks every name of `NAMES` there. */
#ifndef XSP_NAMES_H
#define XSP_NAMES_H
#include <Python.h>

typedef struct {
    PyObject **var; /* where the interned name is kept */
    const char *text;
} PyName;

/* Intern every name: 0, or -1 with an exception set. */
static inline int intern_names(const PyName *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((*names[i].var = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    return 0;
}

/* module.NAMES = the interned names, in table order: 0, or -1 with an exception set. */
static inline int add_names(PyObject *module, const PyName *names, size_t n) {
    PyObject *tuple = PyTuple_New((Py_ssize_t)n);
    if (tuple == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, Py_NewRef(*names[i].var));
    int failed = PyModule_AddObjectRef(module, "NAMES", tuple);
    Py_DECREF(tuple);
    return failed;
}

#define N_NAMES(table) (sizeof(table) / sizeof((table)[0]))

#endif
