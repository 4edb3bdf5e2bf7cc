/* The eval callback of a range that is not the last, in C.
 *
 * ggml's scheduler asks the callback about every node of the graph (about 33 per block) and
 * the range needs one of them: the residual stream after its last block. In Python each
 * question cost ~2 us (334 per decode step of 10 blocks, ~0.7 ms, on every hop). Here it is a
 * string compare. The function pointers come from the caller, so this file needs no ggml
 * header and links against nothing. See node/eval_capture.py.
 *
 * The copied rows are also converted to float16 here, while they are in the cache: the wire's
 * default form of hidden states. In Python the conversion and its overflow check cost four
 * numpy calls on caches the graph left cold (~0.1 ms a hop); here a loop over d_model floats.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The leading fields of struct ggml_tensor (stable across ggml releases). */
struct tensor_head {
    int32_t type;
    void *buffer;
    int64_t ne[4];
};

typedef const char *(*get_name_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

/* Mirrored by node.eval_capture.CaptureState: keep the two in step. */
struct capture {
    get_name_fn get_name;
    tensor_get_fn tensor_get;
    float *dest;
    uint16_t *half_dest; /* the same rows as float16, where every value fits one */
    int64_t capacity_rows;
    int64_t width;
    int64_t rows;
    int64_t bad_width;
    int32_t bad_type;
    int32_t error; /* 0: fine, 1: unexpected type or width, 2: more rows than dest holds */
    int32_t half_ok; /* 1 until a copied value is NaN, infinite or beyond float16's range */
    char name[64];
};

#define HALF_MAX_BITS 0x477FE000u /* 65504.0f: float16's largest finite value */

/* float32 bits -> float16 bits, rounding to nearest even: numpy's npy_floatbits_to_halfbits
 * for every finite |x| <= 65504 (the only values given it; the caller checks). */
static uint16_t half_bits(uint32_t f) {
    uint16_t sign = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t exp = f & 0x7f800000u;
    uint32_t sig;
    if (exp <= 0x38000000u) { /* a float16 subnormal, or zero */
        if (exp < 0x33000000u) {
            return sign;
        }
        exp >>= 23;
        sig = 0x00800000u + (f & 0x007fffffu);
        sig >>= (113 - exp);
        if (((sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) {
            sig += 0x00001000u;
        }
        return (uint16_t)(sign + (uint16_t)(sig >> 13));
    }
    uint16_t h_exp = (uint16_t)((exp - 0x38000000u) >> 13);
    sig = f & 0x007fffffu;
    if ((sig & 0x00003fffu) != 0x00001000u) {
        sig += 0x00001000u;
    }
    return (uint16_t)(sign + (uint16_t)((sig >> 13) + h_exp));
}

/* Rows [first, first + rows) of dest into half_dest; half_ok cleared if one does not fit. */
static void to_half(struct capture *c, int64_t first, int64_t rows) {
    const uint32_t *in = (const uint32_t *)(c->dest + first * c->width);
    uint16_t *out = c->half_dest + first * c->width;
    int64_t n = rows * c->width;
    for (int64_t i = 0; i < n; i++) {
        uint32_t f = in[i];
        if ((f & 0x7fffffffu) > HALF_MAX_BITS) { /* beyond 65504, infinite or NaN */
            c->half_ok = 0;
            return;
        }
        out[i] = half_bits(f);
    }
}

/* Exported for the tests: ``n`` floats converted as the callback converts them; returns 0 when
 * one does not fit float16 (the caller then converts with numpy). */
int inclavate_to_half(const float *in, uint16_t *out, int64_t n) {
    struct capture c = {0};
    c.dest = (float *)in;
    c.half_dest = out;
    c.width = n;
    c.half_ok = 1;
    to_half(&c, 0, 1);
    return c.half_ok;
}

enum { GGML_TYPE_F32 = 0 };

bool inclavate_eval_capture(void *tensor, bool ask, void *user_data) {
    struct capture *c = user_data;
    if (strcmp(c->get_name(tensor), c->name) != 0) {
        return !ask; /* not wanted; a node we did not ask for: carry on */
    }
    if (ask) {
        return true;
    }
    const struct tensor_head *head = tensor;
    if (head->type != GGML_TYPE_F32 || head->ne[0] != c->width) {
        c->error = 1;
        c->bad_type = head->type;
        c->bad_width = head->ne[0];
        return false;
    }
    int64_t rows = head->ne[1];
    if (rows < 0 || c->rows + rows > c->capacity_rows) {
        c->error = 2;
        return false;
    }
    c->tensor_get(tensor, c->dest + c->rows * c->width, 0, (size_t)(rows * c->width) * sizeof(float));
    if (c->half_ok && c->half_dest != NULL) {
        to_half(c, c->rows, rows);
    }
    c->rows += rows;
    return false; /* abort the rest of this ubatch's graph: the norm and vocabulary are not ours */
}

/* float16 bits -> float32 for n values; returns 0 if one is infinite or NaN (the output is
 * then incomplete). Exact: every float16 is a float32. */
int inclavate_from_half(const uint16_t *in, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = in[i];
        uint32_t sign = (h & 0x8000u) << 16;
        uint32_t exp = (h >> 10) & 0x1fu;
        uint32_t sig = h & 0x3ffu;
        uint32_t f;
        if (exp == 0x1fu) {
            return 0;
        }
        if (exp == 0) {
            if (sig == 0) {
                f = sign;
            } else { /* subnormal: normalise */
                exp = 113;
                while (!(sig & 0x400u)) {
                    sig <<= 1;
                    exp--;
                }
                f = sign | (exp << 23) | ((sig & 0x3ffu) << 13);
            }
        } else {
            f = sign | ((exp + 112) << 23) | (sig << 13);
        }
        memcpy(out + i, &f, sizeof f);
    }
    return 1;
}
