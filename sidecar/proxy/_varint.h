/* A protobuf varint, read by both C walkers (_framewalk.c's model name, _messagewalk.c's field
 * scan); each mirrors its Python reference's read_varint (model_name.py, stream_messages.py),
 * which agree: "varint too long" after a tenth continued byte. */
#ifndef XSP_VARINT_H
#define XSP_VARINT_H

#include <Python.h>
#include <stdint.h>

/* A varint at *pos: 1 read (the low 64 bits in *out, *wide if it is larger; *pos moved past
 * it), 0 cut, -1 too long (a tenth continued byte). *pos is left as it was unless it reads. */
static int varint(const unsigned char *b, Py_ssize_t *pos, Py_ssize_t end, uint64_t *out,
                  int *wide) {
    uint64_t value = 0;
    int shift = 0, large = 0;
    Py_ssize_t p = *pos;
    while (p < end) {
        unsigned int c = b[p++];
        uint64_t bits = c & 0x7F;
        if (shift < 63) {
            value |= bits << shift;
        } else { /* shift 63: one bit fits */
            value |= (bits & 1) << 63;
            large = (bits >> 1) != 0;
        }
        if (!(c & 0x80)) {
            *out = value;
            *wide = large;
            *pos = p;
            return 1;
        }
        shift += 7;
        if (shift > 63)
            return -1;
    }
    return 0;
}

#endif
