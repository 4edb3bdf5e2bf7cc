/* The eval callback of a range that is not the last, in C.
 *
 * ggml's scheduler asks the callback about every node of the graph (about 33 per block) and
 * the range needs one of them: the residual stream after its last block. In Python each
 * question cost ~2 us (334 per decode step of 10 blocks, ~0.7 ms, on every hop). Here it is a
 * string compare. The function pointers come from the caller, so this file needs no ggml
 * header and links against nothing. See node/eval_capture.py.
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
    int64_t capacity_rows;
    int64_t width;
    int64_t rows;
    int64_t bad_width;
    int32_t bad_type;
    int32_t error; /* 0: fine, 1: unexpected type or width, 2: more rows than dest holds */
    char name[64];
};

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
    c->rows += rows;
    return false; /* abort the rest of this ubatch's graph: the norm and vocabulary are not ours */
}
