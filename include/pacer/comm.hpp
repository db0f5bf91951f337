// pacer::comm: communicators, data collectives over MPI and NCCL, the overlapped gradient reducer, and comm bench/tune.
#pragma once

#include "pacer/comm/bench.hpp"
#include "pacer/comm/collectives.hpp"
#include "pacer/comm/communicator.hpp"
#include "pacer/comm/reducer.hpp"
