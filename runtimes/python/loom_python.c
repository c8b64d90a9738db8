
/*
 * Copyright (C) resty-loom authors
 *
 * loom_python: an offload runtime (include/loom_offload.h) that embeds
 * CPython and calls a Python function with the call's bytes.
 *
 * Configuration string given to offload.load(): key=value pairs
 * separated by spaces, commas or semicolons:
 *
 *     module=<name>      module to import (required)
 *     function=<name>    function called per call (default "handle"):
 *                        f(payload: bytes) -> bytes | bytearray | str |
 *                        None | any object with a contiguous buffer
 *     init=<name>        optional function called once after the import,
 *                        with the whole configuration string
 *     path=<dir>[:<dir>] directories put first on sys.path
 *     home=<prefix>      Python home (default: the prefix it was built for)
 *
 * The interpreter starts (once per worker process) and the module is
 * imported in loom_offload_init(), which the host calls on a start-up
 * thread, never on the nginx event loop. Each runtime then serves calls
 * on its own threads; they hold the GIL only while Python code runs.
 * The function's module stays loaded for the life of the worker, so
 * module-level objects (caches, connection pools) keep state between
 * calls. An exception becomes the error "<Type>: <message>" followed by
 * the Python traceback.
 *
 * The built-in module "loom" gives handlers:
 *     loom.cancelled()      True once nobody waits for the current call
 *     loom.log(level, msg)  writes to the nginx error log
 *     loom.worker()         the nginx worker id
 *     loom.LOG_ERR, LOG_WARN, LOG_NOTICE, LOG_INFO, LOG_DEBUG
 */


#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#ifndef LOOM_PY_HOME
#define LOOM_PY_HOME  "/usr"
#endif

#ifndef LOOM_PY_LIBNAME
#define LOOM_PY_LIBNAME  "libpython3.11.so.1.0"
#endif

/* a thread wakes up from host->wait() at least this often */
#define LOOM_PY_WAIT_MS  1000


typedef struct {
    const loom_offload_host_t  *host;
    loom_offload_queue_t       *queue;
    PyObject                   *func;
    char                        name[128];   /* module.function */
    pthread_t                  *threads;
    unsigned int                nthreads;
    int                         worker;
} loom_py_rt_t;


__attribute__((visibility("default")))
int loom_offload_init(loom_offload_init_t *init);
__attribute__((visibility("default")))
void loom_offload_shutdown(void *instance);

static int loom_py_start_interpreter(const char *home, char *err,
    size_t err_size);
static void loom_py_block_signals(void);
static void *loom_py_thread(void *arg);
static void loom_py_serve(loom_py_rt_t *rt, loom_offload_task_t *task);
static PyObject *loom_py_format_exception(void);
static void loom_py_log_exception(loom_py_rt_t *rt, const char *exc,
    size_t len);
static char *loom_py_config_get(const char *cfg, const char *key);
static void loom_py_set_err(loom_offload_init_t *init, const char *fmt,
    const char *arg);
static PyObject *loom_py_module_init(void);


/* the task and runtime the current thread serves (for the loom module) */
static __thread loom_offload_task_t  *loom_py_task;
static __thread loom_py_rt_t         *loom_py_rt;

static pthread_mutex_t  loom_py_mutex = PTHREAD_MUTEX_INITIALIZER;
static PyObject        *loom_py_traceback_format;
static PyObject        *loom_py_traceback_format_only;


/* the "loom" built-in module */

static PyObject *
loom_py_cancelled(PyObject *self, PyObject *args)
{
    loom_offload_task_t  *task = loom_py_task;

    if (task != NULL && loom_py_rt->host->cancelled(task)) {
        Py_RETURN_TRUE;
    }

    Py_RETURN_FALSE;
}


static PyObject *
loom_py_log(PyObject *self, PyObject *args)
{
    int          level;
    const char  *msg;
    Py_ssize_t   len;

    if (!PyArg_ParseTuple(args, "is#", &level, &msg, &len)) {
        return NULL;
    }

    if (loom_py_rt != NULL) {
        loom_py_rt->host->log(loom_py_rt->queue, level, msg, (size_t) len);
    }

    Py_RETURN_NONE;
}


static PyObject *
loom_py_worker(PyObject *self, PyObject *args)
{
    return PyLong_FromLong(loom_py_rt != NULL ? loom_py_rt->worker : -1);
}


static PyMethodDef  loom_py_methods[] = {
    { "cancelled", loom_py_cancelled, METH_NOARGS,
      "True once nobody waits for the answer of the current call." },
    { "log", loom_py_log, METH_VARARGS,
      "log(level, msg): write msg to the nginx error log." },
    { "worker", loom_py_worker, METH_NOARGS,
      "The nginx worker id." },
    { NULL, NULL, 0, NULL }
};


static struct PyModuleDef  loom_py_module = {
    PyModuleDef_HEAD_INIT, "loom",
    "resty-loom offload runtime helpers", -1, loom_py_methods,
    NULL, NULL, NULL, NULL
};


static PyObject *
loom_py_module_init(void)
{
    PyObject  *m;

    m = PyModule_Create(&loom_py_module);
    if (m == NULL) {
        return NULL;
    }

    PyModule_AddIntConstant(m, "LOG_ERR", LOOM_OFFLOAD_LOG_ERR);
    PyModule_AddIntConstant(m, "LOG_WARN", LOOM_OFFLOAD_LOG_WARN);
    PyModule_AddIntConstant(m, "LOG_NOTICE", LOOM_OFFLOAD_LOG_NOTICE);
    PyModule_AddIntConstant(m, "LOG_INFO", LOOM_OFFLOAD_LOG_INFO);
    PyModule_AddIntConstant(m, "LOG_DEBUG", LOOM_OFFLOAD_LOG_DEBUG);

    return m;
}


/*
 * subprocess takes ECHILD from waitpid() to mean "exited, status
 * unknown" and reports returncode 0: a failed command looks like a
 * success. The host leaves the children of runtime threads to them (see
 * the SIGCHLD notes in src/ngx_loom_offload_sigchld.c), but whatever else reaps
 * one (a module's waitpid(-1) running at the same moment) must not turn
 * into a false success: the call raises ChildProcessError instead.
 */
static const char  loom_py_subprocess_patch[] =
    "def _loom_patch():\n"
    "    import errno, os, subprocess\n"
    "    def lost(pid):\n"
    "        return ChildProcessError(errno.ECHILD, 'exit status of process'\n"
    "            ' %d lost: something else in the nginx worker reaped it'\n"
    "            % pid)\n"
    "    def try_wait(self, flags):\n"
    "        try:\n"
    "            return os.waitpid(self.pid, flags)\n"
    "        except ChildProcessError:\n"
    "            raise lost(self.pid) from None\n"
    "    class Lost(subprocess.SubprocessError):\n"
    "        pass\n"
    "    def waitpid(pid, flags):\n"
    "        try:\n"
    "            return os.waitpid(pid, flags)\n"
    "        except ChildProcessError:\n"
    "            raise Lost(lost(pid)) from None\n"
    "    poll = subprocess.Popen._internal_poll\n"
    "    def internal_poll(self, _deadstate=None):\n"
    "        if _deadstate is not None:\n"
    "            return poll(self, _deadstate)\n"
    "        try:\n"
    "            return poll(self, None, _waitpid=waitpid)\n"
    "        except Lost as e:\n"
    "            raise e.args[0] from None\n"
    "    subprocess.Popen._try_wait = try_wait\n"
    "    subprocess.Popen._internal_poll = internal_poll\n"
    "_loom_patch()\n"
    "del _loom_patch\n";


/* start-up */

static int
loom_py_start_interpreter(const char *home, char *err, size_t err_size)
{
    PyObject  *tb;
    PyConfig   config;
    PyStatus   status;

    if (Py_IsInitialized()) {
        return 0;
    }

    /*
     * Extension modules (lib-dynload) expect libpython's symbols in the
     * global scope; the host may have loaded us with RTLD_LOCAL.
     */
    if (dlopen(LOOM_PY_LIBNAME, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)
        == NULL)
    {
        snprintf(err, err_size, "failed to load %s: %s", LOOM_PY_LIBNAME,
                 dlerror());
        return -1;
    }

    if (PyImport_AppendInittab("loom", loom_py_module_init) != 0) {
        snprintf(err, err_size, "failed to register the loom module");
        return -1;
    }

    PyConfig_InitPythonConfig(&config);

    /* signals belong to nginx */
    config.install_signal_handlers = 0;
    config.parse_argv = 0;
    config.user_site_directory = 0;

    status = PyConfig_SetBytesString(&config, &config.home, home);
    if (!PyStatus_Exception(status)) {
        status = PyConfig_SetBytesString(&config, &config.program_name,
                                         "nginx");
    }

    if (!PyStatus_Exception(status)) {
        status = Py_InitializeFromConfig(&config);
    }

    PyConfig_Clear(&config);

    if (PyStatus_Exception(status)) {
        snprintf(err, err_size, "failed to start python: %s",
                 status.err_msg ? status.err_msg : "unknown error");
        return -1;
    }

    /* this thread holds the GIL now */

    tb = PyImport_ImportModule("traceback");
    if (tb != NULL) {
        loom_py_traceback_format = PyObject_GetAttrString(tb,
                                                      "format_exception");
        loom_py_traceback_format_only = PyObject_GetAttrString(tb,
                                                 "format_exception_only");
        Py_DECREF(tb);
    }

    PyErr_Clear();

    if (PyRun_SimpleString(loom_py_subprocess_patch) != 0) {
        PyErr_Clear();
    }

    (void) PyEval_SaveThread();

    return 0;
}


static void
loom_py_block_signals(void)
{
    sigset_t  set;

    sigfillset(&set);
    sigdelset(&set, SIGILL);
    sigdelset(&set, SIGBUS);
    sigdelset(&set, SIGFPE);
    sigdelset(&set, SIGSEGV);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}


static char *
loom_py_config_get(const char *cfg, const char *key)
{
    size_t       klen, vlen;
    const char  *p, *end, *v;
    char        *val;

    klen = strlen(key);
    p = cfg;

    while (*p) {
        while (*p == ' ' || *p == ',' || *p == ';' || *p == '\t'
               || *p == '\n')
        {
            p++;
        }

        end = p;
        while (*end && *end != ' ' && *end != ',' && *end != ';'
               && *end != '\t' && *end != '\n')
        {
            end++;
        }

        if ((size_t) (end - p) > klen && strncmp(p, key, klen) == 0
            && p[klen] == '=')
        {
            v = p + klen + 1;
            vlen = end - v;
            val = malloc(vlen + 1);
            if (val == NULL) {
                return NULL;
            }

            memcpy(val, v, vlen);
            val[vlen] = '\0';
            return val;
        }

        p = end;
    }

    return NULL;
}


static void
loom_py_set_err(loom_offload_init_t *init, const char *fmt, const char *arg)
{
    if (init->err != NULL && init->err_size > 0) {
        snprintf(init->err, init->err_size, fmt, arg);
    }
}


/* sys.path[0:0] = path.split(":") */
static int
loom_py_add_path(const char *path)
{
    PyObject  *sys_path, *item;
    char      *copy, *dir, *save;
    int        i, rc;

    sys_path = PySys_GetObject("path");     /* borrowed */
    if (sys_path == NULL || !PyList_Check(sys_path)) {
        PyErr_SetString(PyExc_RuntimeError, "sys.path is not a list");
        return -1;
    }

    copy = strdup(path);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }

    rc = 0;
    i = 0;

    for (dir = strtok_r(copy, ":", &save); dir != NULL;
         dir = strtok_r(NULL, ":", &save))
    {
        item = PyUnicode_DecodeFSDefault(dir);
        if (item == NULL || PyList_Insert(sys_path, i++, item) != 0) {
            Py_XDECREF(item);
            rc = -1;
            break;
        }

        Py_DECREF(item);
    }

    free(copy);
    return rc;
}


int
loom_offload_init(loom_offload_init_t *init)
{
    int                rc;
    char              *module, *function, *initfn, *path, *home, *msg;
    PyObject          *mod, *func, *fn, *res, *exc;
    unsigned int       i;
    loom_py_rt_t      *rt;
    PyGILState_STATE   gil;

    if (init->abi_version < LOOM_OFFLOAD_ABI_VERSION || init->host == NULL
        || init->host->size < sizeof(loom_offload_host_t))
    {
        loom_py_set_err(init, "%s", "unsupported host ABI version");
        return -1;
    }

    loom_py_block_signals();

    module = loom_py_config_get(init->config, "module");
    function = loom_py_config_get(init->config, "function");
    initfn = loom_py_config_get(init->config, "init");
    path = loom_py_config_get(init->config, "path");
    home = loom_py_config_get(init->config, "home");

    rc = -1;
    rt = NULL;
    func = NULL;

    if (module == NULL) {
        loom_py_set_err(init, "%s", "config has no module=<name>");
        goto done;
    }

    pthread_mutex_lock(&loom_py_mutex);
    rc = loom_py_start_interpreter(home ? home : LOOM_PY_HOME, init->err,
                                   init->err_size);
    pthread_mutex_unlock(&loom_py_mutex);

    if (rc != 0) {
        goto done;
    }

    rc = -1;

    rt = calloc(1, sizeof(loom_py_rt_t));
    if (rt == NULL) {
        loom_py_set_err(init, "%s", "no memory");
        goto done;
    }

    rt->host = init->host;
    rt->queue = init->queue;
    rt->worker = init->worker;
    rt->nthreads = init->threads ? init->threads : 1;

    gil = PyGILState_Ensure();

    /* module-level code may use loom.log() */
    loom_py_rt = rt;

    if (path != NULL && loom_py_add_path(path) != 0) {
        goto py_error;
    }

    mod = PyImport_ImportModule(module);
    if (mod == NULL) {
        goto py_error;
    }

    func = PyObject_GetAttrString(mod, function ? function : "handle");
    fn = initfn ? PyObject_GetAttrString(mod, initfn) : NULL;
    Py_DECREF(mod);

    if (func == NULL || (initfn != NULL && fn == NULL)) {
        Py_XDECREF(fn);
        goto py_error;
    }

    if (!PyCallable_Check(func)) {
        Py_XDECREF(fn);
        PyErr_Format(PyExc_TypeError, "%s.%s is not callable", module,
                     function ? function : "handle");
        goto py_error;
    }

    if (fn != NULL) {
        res = PyObject_CallFunction(fn, "s#", init->config,
                                    (Py_ssize_t) init->config_len);
        Py_DECREF(fn);
        if (res == NULL) {
            goto py_error;
        }

        Py_DECREF(res);
    }

    rt->func = func;
    func = NULL;
    loom_py_rt = NULL;

    snprintf(rt->name, sizeof(rt->name), "%s.%s", module,
             function ? function : "handle");
    PyGILState_Release(gil);

    rt->threads = calloc(rt->nthreads, sizeof(pthread_t));
    if (rt->threads == NULL) {
        loom_py_set_err(init, "%s", "no memory");
        goto done;
    }

    for (i = 0; i < rt->nthreads; i++) {
        if (pthread_create(&rt->threads[i], NULL, loom_py_thread, rt) != 0) {
            /* the host closes the queue: threads started so far leave */
            loom_py_set_err(init, "%s", "failed to start a thread");
            rt = NULL;
            goto done;
        }
    }

    init->instance = rt;
    rt = NULL;
    rc = 0;
    goto done;

py_error:

    exc = loom_py_format_exception();
    msg = exc ? (char *) PyUnicode_AsUTF8(exc) : NULL;
    loom_py_set_err(init, "failed to load python handler: %s",
                    msg ? msg : "unknown error");
    Py_XDECREF(exc);
    Py_XDECREF(func);
    PyErr_Clear();
    loom_py_rt = NULL;
    PyGILState_Release(gil);

done:

    if (rt != NULL) {
        free(rt->threads);
        free(rt);
    }

    free(module);
    free(function);
    free(initfn);
    free(path);
    free(home);

    return rc;
}


/*
 * "<Type>: <message>\n" followed by the traceback, from the pending
 * exception (cleared). Needs the GIL.
 */
static PyObject *
loom_py_format_exception(void)
{
    PyObject  *type, *value, *tb, *lines, *sep, *head, *full, *res;

    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return PyUnicode_FromString("unknown error");
    }

    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }

    res = NULL;
    head = NULL;
    full = NULL;
    sep = PyUnicode_FromString("");

    if (sep != NULL && loom_py_traceback_format_only != NULL) {
        lines = PyObject_CallFunctionObjArgs(loom_py_traceback_format_only,
                                             type, value ? value : Py_None,
                                             NULL);
        if (lines != NULL) {
            head = PyUnicode_Join(sep, lines);
            Py_DECREF(lines);
        }
    }

    if (sep != NULL && tb != NULL && loom_py_traceback_format != NULL) {
        lines = PyObject_CallFunctionObjArgs(loom_py_traceback_format,
                                             type, value ? value : Py_None,
                                             tb, NULL);
        if (lines != NULL) {
            full = PyUnicode_Join(sep, lines);
            Py_DECREF(lines);
        }
    }

    if (head != NULL && full != NULL) {
        res = PyUnicode_FromFormat("%U%U", head, full);

    } else if (head != NULL) {
        Py_INCREF(head);
        res = head;
    }

    if (res == NULL) {
        PyErr_Clear();
        res = value ? PyObject_Str(value) : NULL;
        if (res == NULL) {
            PyErr_Clear();
            res = PyUnicode_FromString("python exception");
        }
    }

    /* no trailing newline */
    if (res != NULL && PyUnicode_GET_LENGTH(res) > 0
        && PyUnicode_READ_CHAR(res, PyUnicode_GET_LENGTH(res) - 1) == '\n')
    {
        full = PyUnicode_Substring(res, 0, PyUnicode_GET_LENGTH(res) - 1);
        if (full != NULL) {
            Py_DECREF(res);
            res = full;
            full = NULL;
        }
    }

    Py_XDECREF(full);
    Py_XDECREF(head);
    Py_XDECREF(sep);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();

    return res;
}


static void
loom_py_log_exception(loom_py_rt_t *rt, const char *exc, size_t len)
{
    int    n;
    char  *msg;

    msg = malloc(sizeof(rt->name) + len + 32);
    if (msg == NULL) {
        return;
    }

    n = sprintf(msg, "python handler %s raised %.*s", rt->name, (int) len,
                exc);

    rt->host->log(rt->queue, LOOM_OFFLOAD_LOG_ERR, msg, (size_t) n);
    free(msg);
}


/* one call; the GIL is held */
static void
loom_py_serve(loom_py_rt_t *rt, loom_offload_task_t *task)
{
    size_t                len;
    PyObject             *arg, *res, *exc;
    Py_buffer             view;
    Py_ssize_t            n;
    const char           *data;
    const unsigned char  *req;

    req = rt->host->request(task, &len);

    arg = PyBytes_FromStringAndSize((const char *) req, (Py_ssize_t) len);
    if (arg == NULL) {
        goto error;
    }

    res = PyObject_CallOneArg(rt->func, arg);
    Py_DECREF(arg);

    if (res == NULL) {
        goto error;
    }

    if (PyBytes_Check(res)) {
        rt->host->answer(task, LOOM_OFFLOAD_OK, PyBytes_AS_STRING(res),
                         (size_t) PyBytes_GET_SIZE(res));

    } else if (PyByteArray_Check(res)) {
        rt->host->answer(task, LOOM_OFFLOAD_OK, PyByteArray_AS_STRING(res),
                         (size_t) PyByteArray_GET_SIZE(res));

    } else if (PyUnicode_Check(res)) {
        data = PyUnicode_AsUTF8AndSize(res, &n);
        if (data == NULL) {
            Py_DECREF(res);
            goto error;
        }

        rt->host->answer(task, LOOM_OFFLOAD_OK, data, (size_t) n);

    } else if (res == Py_None) {
        rt->host->answer(task, LOOM_OFFLOAD_OK, NULL, 0);

    } else if (PyObject_CheckBuffer(res)) {
        /* memoryview, array.array, ...: any C-contiguous buffer */
        if (PyObject_GetBuffer(res, &view, PyBUF_C_CONTIGUOUS) != 0) {
            Py_DECREF(res);
            goto error;
        }

        rt->host->answer(task, LOOM_OFFLOAD_OK, view.buf, (size_t) view.len);
        PyBuffer_Release(&view);

    } else {
        PyErr_Format(PyExc_TypeError,
                     "handler returned %.100s, expected bytes",
                     Py_TYPE(res)->tp_name);
        Py_DECREF(res);
        goto error;
    }

    Py_DECREF(res);
    return;

error:

    exc = loom_py_format_exception();
    data = exc ? PyUnicode_AsUTF8AndSize(exc, &n) : NULL;
    if (data == NULL) {
        PyErr_Clear();
        data = "python exception";
        n = (Py_ssize_t) strlen(data);
    }

    /* a bug, not an answer: the log gets it too, with the traceback */
    loom_py_log_exception(rt, data, (size_t) n);

    rt->host->answer(task, LOOM_OFFLOAD_ERROR, data, (size_t) n);
    Py_XDECREF(exc);
}


static void *
loom_py_thread(void *arg)
{
    int                   rc;
    loom_py_rt_t         *rt = arg;
    PyThreadState        *ts;
    PyGILState_STATE      gil;
    loom_offload_task_t  *task;

    loom_py_block_signals();

    gil = PyGILState_Ensure();
    ts = PyEval_SaveThread();

    loom_py_rt = rt;

    for ( ;; ) {
        task = NULL;
        rc = rt->host->wait(rt->queue, LOOM_PY_WAIT_MS, &task);

        if (rc == LOOM_OFFLOAD_CLOSED) {
            break;
        }

        if (rc != LOOM_OFFLOAD_TASK || task == NULL) {
            continue;
        }

        PyEval_RestoreThread(ts);
        loom_py_task = task;
        loom_py_serve(rt, task);
        loom_py_task = NULL;
        ts = PyEval_SaveThread();
    }

    loom_py_rt = NULL;

    PyEval_RestoreThread(ts);
    PyGILState_Release(gil);

    return NULL;
}


void
loom_offload_shutdown(void *instance)
{
    loom_py_rt_t      *rt = instance;
    unsigned int       i;
    PyGILState_STATE   gil;

    if (rt == NULL) {
        return;
    }

    /*
     * The queue is closed: threads leave after their current call. One
     * stuck in a call keeps us here; the host stops waiting after its
     * grace period. The interpreter itself is never finalized: other
     * runtimes of this worker may use it, and the process is exiting.
     */
    for (i = 0; i < rt->nthreads; i++) {
        pthread_join(rt->threads[i], NULL);
    }

    gil = PyGILState_Ensure();
    Py_CLEAR(rt->func);
    PyGILState_Release(gil);

    free(rt->threads);
    free(rt);
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
