/* asteria/asteria.h - umbrella header of libasteria's public C API. */
#ifndef ASTERIA_ASTERIA_H
#define ASTERIA_ASTERIA_H

#include "asteria/build_config.h"
#include "asteria/coherence.h"
#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "asteria/pool.h"
#include "asteria/quant.h"
#include "asteria/runtime.h"
#include "asteria/shadow.h"
#include "asteria/store.h"
#include "asteria/trace.h"

#endif
