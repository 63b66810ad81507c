// The generic fp32 score kernel compiled for portable.
#define DSA_GENERIC_KERNEL_NAME portable_kernel
#define DSA_GENERIC_KERNEL_LABEL "portable"
#include "cpu/score/score_generic.h"
