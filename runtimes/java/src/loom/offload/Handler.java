package loom.offload;

/**
 * A handler of resty-loom offload calls: rt:call("<class name>", data) in
 * Lua runs call(data) on one of the runtime's Java threads.
 *
 * One instance per class and per offload.load() in each nginx worker, made
 * with the public no-argument constructor on first use and shared by all
 * the runtime's threads: keep state in fields, make it thread-safe.
 * An exception becomes the call's error ("<class>: <message>") and is
 * logged once with its stack trace.
 */
public interface Handler {
    byte[] call(byte[] in) throws Exception;
}
