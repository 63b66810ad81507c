// Umbrella header of the dsa C++ API.
#pragma once

#include "dsa/backend.h"
#include "dsa/compressor.h"
#include "dsa/compressor_append.h"
#include "dsa/error.h"
#include "dsa/dense_indexer.h"
#include "dsa/indexer.h"
#include "dsa/indexer_decode.h"
#include "dsa/kl_loss.h"
#include "dsa/layout.h"
#include "dsa/paged_cache.h"
#include "dsa/peak.h"
#include "dsa/runtime.h"
#include "dsa/sparse_attention.h"
#include "dsa/sparse_attention_decode.h"
#include "dsa/tensor.h"
