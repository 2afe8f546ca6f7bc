//! The lifetime planner from C: `teraio_plan_json` is the planner's `plan_and_predict` on JSON
//! text (what `teraio plan --json` prints and Python's `teraio.plan` returns), and
//! `teraio_string_free` releases the text it hands out.

use std::ffi::{c_char, CStr, CString};

use crate::status::teraio_status::{self, *};
use crate::status::{guard, Failure};

/// A NUL-terminated UTF-8 argument, or INVALID_ARGUMENT naming it.
///
/// # Safety
/// `text` must be NULL or a NUL-terminated string.
unsafe fn utf8_argument<'a>(text: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if text.is_null() {
        return Err(Failure::new(TERAIO_ERR_INVALID_ARGUMENT, format!("{what} is NULL")));
    }
    // SAFETY: caller contract.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|e| Failure::new(TERAIO_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8: {e}")))
}

/// Plans tensor migrations for a training trace and predicts the iteration (docs/planner.md).
/// `trace_json` is a trace (docs/trace.md); `request_json` is `{"hardware": {...}, "options":
/// {...}}` with the planner's `Hardware` fields (`gpu_capacity_bytes`, `ssd_read_bytes_per_s`,
/// `ssd_write_bytes_per_s`, `ssd_latency_us`, `host_capacity_bytes`, `host_link_bytes_per_s`,
/// `host_latency_us`, optional `ssd_shared`, `ssd_via_host_link`) and optional `options`
/// (`planner`: `PlannerConfig` fields, `movable_kinds`). On success `*out_json` is
/// `{"prediction": {...}, "plan": {...}}`, the document `teraio plan --json` prints.
///
/// Errors: `INVALID_ARGUMENT` (a NULL pointer, text that is not UTF-8, a trace or request that
/// does not decode or breaks a rule; the message names it).
/// Ownership: `*out_json` is the library's; release it with `teraio_string_free`. It is left
/// unchanged on failure. Threads: safe; planning a large trace takes a while (no store is used).
///
/// # Safety
/// `trace_json` and `request_json` must be NULL or NUL-terminated strings; `out_json` must be
/// NULL or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn teraio_plan_json(
    trace_json: *const c_char,
    request_json: *const c_char,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard(|| {
        if out_json.is_null() {
            return Err(Failure::new(TERAIO_ERR_INVALID_ARGUMENT, "out_json is NULL"));
        }
        // SAFETY: caller contract.
        let (trace, request) =
            unsafe { (utf8_argument(trace_json, "trace_json")?, utf8_argument(request_json, "request_json")?) };
        let text = teraio_planner::predict::plan_and_predict_json(trace, request)
            .map_err(|e| Failure::new(TERAIO_ERR_INVALID_ARGUMENT, e.to_string()))?;
        let text =
            CString::new(text).map_err(|_| Failure::new(TERAIO_ERR_INTERNAL, "the plan JSON holds a NUL byte"))?;
        // SAFETY: checked non-NULL above; caller contract for validity.
        unsafe { out_json.write(text.into_raw()) };
        Ok(())
    })
}

/// Releases a string the library handed out (`teraio_plan_json`'s `*out_json`). NULL is a no-op.
///
/// # Safety
/// `text` must be NULL or a string from this library not yet released.
#[no_mangle]
pub unsafe extern "C" fn teraio_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: caller contract: it came from `CString::into_raw` in this library.
        drop(unsafe { CString::from_raw(text) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::null_mut;

    fn last_message() -> String {
        // SAFETY: the library's own static-per-thread message.
        unsafe { CStr::from_ptr(crate::teraio_last_error_message()) }.to_string_lossy().into_owned()
    }

    /// Eight 10 ms ops; a 64 MiB activation written at op 0 and read at op 7, a 64 MiB temporary
    /// at ops 3 and 4.
    const TRACE: &str = r#"{"format_version": 1, "description": "c", "gpu_capacity_bytes": 1073741824,
        "ops": [{"name": "f0", "duration_us": 10000.0, "phase": "forward"},
                {"name": "f1", "duration_us": 10000.0, "phase": "forward"},
                {"name": "f2", "duration_us": 10000.0, "phase": "forward"},
                {"name": "f3", "duration_us": 10000.0, "phase": "forward"},
                {"name": "b4", "duration_us": 10000.0, "phase": "backward"},
                {"name": "b5", "duration_us": 10000.0, "phase": "backward"},
                {"name": "b6", "duration_us": 10000.0, "phase": "backward"},
                {"name": "b7", "duration_us": 10000.0, "phase": "backward"}],
        "tensors": [
          {"id": 1, "name": "act", "size_bytes": 67108864, "kind": "activation", "alloc_op": 0, "free_op": 7,
           "uses": [{"op": 0, "access": "write"}, {"op": 7, "access": "read"}]},
          {"id": 2, "name": "tmp", "size_bytes": 67108864, "kind": "temporary", "alloc_op": 3, "free_op": 4,
           "uses": [{"op": 3, "access": "write"}, {"op": 4, "access": "read"}]}]}"#;

    const REQUEST: &str = r#"{"hardware": {"gpu_capacity_bytes": 100000000, "ssd_read_bytes_per_s": 6.5e9,
        "ssd_write_bytes_per_s": 6.5e9, "ssd_latency_us": 20.0, "host_capacity_bytes": 0,
        "host_link_bytes_per_s": 25e9, "host_latency_us": 10.0},
        "options": {"movable_kinds": ["activation"]}}"#;

    #[test]
    fn plans_from_json_and_hands_out_text_to_free() {
        let trace = CString::new(TRACE).unwrap();
        let request = CString::new(REQUEST).unwrap();
        let mut out: *mut c_char = null_mut();
        // SAFETY: valid strings and out pointer.
        let status = unsafe { teraio_plan_json(trace.as_ptr(), request.as_ptr(), &mut out) };
        assert_eq!(status, TERAIO_OK, "{}", last_message());
        // SAFETY: the library's string, released right after.
        let text = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
        unsafe { teraio_string_free(out) };
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        // 128 MiB at once do not fit in 100 MB: the activation moves, and only it may.
        assert_eq!(value["prediction"]["fits"], true, "{text}");
        assert_eq!(value["plan"]["migrations"][0]["tensor_id"], 1, "{text}");
        assert!(value["prediction"]["iteration_time_us"].as_f64().unwrap() >= 80_000.0, "{text}");
    }

    #[test]
    fn bad_input_is_named_and_leaves_the_output_alone() {
        let trace = CString::new(TRACE).unwrap();
        let misspelt = CString::new(r#"{"hardware": {}, "option": {}}"#).unwrap();
        let mut out: *mut c_char = null_mut();
        // SAFETY: valid strings and out pointer.
        let status = unsafe { teraio_plan_json(trace.as_ptr(), misspelt.as_ptr(), &mut out) };
        assert_eq!(status, TERAIO_ERR_INVALID_ARGUMENT);
        assert!(out.is_null());
        assert!(last_message().contains("request"), "{}", last_message());
        // SAFETY: NULL arguments are what is being tested.
        let status = unsafe { teraio_plan_json(std::ptr::null(), misspelt.as_ptr(), &mut out) };
        assert_eq!(status, TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_message().contains("trace_json"), "{}", last_message());
        // SAFETY: NULL is a no-op.
        unsafe { teraio_string_free(null_mut()) };
    }
}
