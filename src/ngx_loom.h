
/*
 * Copyright (C) resty-loom authors
 */


#ifndef _NGX_LOOM_H_INCLUDED_
#define _NGX_LOOM_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>


/* the release; every Lua module's _VERSION is the same */
#define NGX_LOOM_VERSION     "0.2.0"


/* return codes of FFI entry points, the same values lua-resty-core uses */
#define LOOM_FFI_OK           0
#define LOOM_FFI_ERROR       -1
#define LOOM_FFI_AGAIN       -2
#define LOOM_FFI_BUSY        -3
#define LOOM_FFI_DECLINED    -5
#define LOOM_FFI_BAD_CONTEXT -101


#endif /* _NGX_LOOM_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
