package loom.offload;

import java.nio.charset.StandardCharsets;

/** A Handler that takes and returns UTF-8 text. */
public abstract class StringHandler implements Handler {

    public abstract String call(String in) throws Exception;

    @Override
    public final byte[] call(byte[] in) throws Exception {
        String out = call(new String(in, StandardCharsets.UTF_8));
        return out == null ? null : out.getBytes(StandardCharsets.UTF_8);
    }
}
