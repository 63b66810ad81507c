// Umbrella header of the dsa C++ API.
#pragma once

#include "dsa/backend.h"
#include "dsa/error.h"
#include "dsa/indexer.h"
#include "dsa/layout.h"
#include "dsa/sparse_attention.h"
#include "dsa/tensor.h"
