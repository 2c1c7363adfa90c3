//! Python values ↔ JSON values, so a request dict becomes exactly the body the HTTP service would
//! parse, and a response value becomes the dict an HTTP client would decode.
//!
//! The Python → JSON direction is strict in the same places as the HTTP JSON parser: only
//! JSON-representable values (dict with str keys, list/tuple, str, int, float, bool, None), no
//! NaN or infinity, integers within 64 bits. A failure names the field (`token_ids[3]: …`).

use kvroute_service::http::types::{PromptRouteBody, ReservationBody, SelectBody};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};
use serde::de::DeserializeOwned;
use serde_json::{Map, Number, Value};

/// Deepest nesting accepted (the HTTP parser's recursion limit is 128; bodies nest ≤ 3 levels).
const MAX_DEPTH: usize = 64;

/// A conversion failure, with the path to the offending value built while unwinding.
struct ConvertError {
    path: Vec<Segment>,
    message: String,
    type_error: bool,
}

enum Segment {
    Key(String),
    Index(usize),
}

impl ConvertError {
    fn value(message: String) -> Self {
        Self {
            path: Vec::new(),
            message,
            type_error: false,
        }
    }

    fn type_error(message: String) -> Self {
        Self {
            path: Vec::new(),
            message,
            type_error: true,
        }
    }

    fn at(mut self, segment: Segment) -> Self {
        self.path.push(segment);
        self
    }

    fn into_pyerr(self) -> PyErr {
        let mut path = String::new();
        for segment in self.path.iter().rev() {
            match segment {
                Segment::Key(k) if path.is_empty() => path.push_str(k),
                Segment::Key(k) => {
                    path.push('.');
                    path.push_str(k);
                }
                Segment::Index(i) => path.push_str(&format!("[{i}]")),
            }
        }
        let message = if path.is_empty() {
            self.message
        } else {
            format!("{path}: {}", self.message)
        };
        if self.type_error {
            PyTypeError::new_err(message)
        } else {
            PyValueError::new_err(message)
        }
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_string())
}

fn convert(obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, ConvertError> {
    if depth > MAX_DEPTH {
        return Err(ConvertError::value(format!(
            "values nested deeper than {MAX_DEPTH} levels"
        )));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    // bool before int: bool is a subclass of int in Python, a distinct type in JSON.
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::Number(v.into()));
        }
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(Value::Number(v.into()));
        }
        return Err(ConvertError::value(format!(
            "integer {obj} does not fit in 64 bits"
        )));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return s
            .to_cow()
            .map(|s| Value::String(s.into_owned()))
            .map_err(|e| ConvertError::value(e.to_string()));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(convert(&item, depth + 1).map_err(|e| e.at(Segment::Index(i)))?);
        }
        return Ok(Value::Array(out));
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        return convert_dict(dict, depth);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            out.push(convert(&item, depth + 1).map_err(|e| e.at(Segment::Index(i)))?);
        }
        return Ok(Value::Array(out));
    }
    if obj.is_instance_of::<PyFloat>() {
        let v: f64 = obj
            .extract()
            .map_err(|e: PyErr| ConvertError::value(e.to_string()))?;
        return Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| ConvertError::value(format!("{v} is not a JSON number")));
    }
    Err(ConvertError::type_error(format!(
        "expected a JSON-like value (dict, list, tuple, str, int, float, bool or None), got {}",
        type_name(obj)
    )))
}

fn convert_dict(dict: &Bound<'_, PyDict>, depth: usize) -> Result<Value, ConvertError> {
    let mut map = Map::new();
    for (key, value) in dict.iter() {
        let Ok(key) = key.cast::<PyString>() else {
            return Err(ConvertError::type_error(format!(
                "dict keys must be str, got {} key {key}",
                type_name(&key)
            )));
        };
        let key = key
            .to_cow()
            .map_err(|e| ConvertError::value(e.to_string()))?
            .into_owned();
        let value = convert(&value, depth + 1).map_err(|e| e.at(Segment::Key(key.clone())))?;
        map.insert(key, value);
    }
    Ok(Value::Object(map))
}

/// A request dict as a typed body, exactly as the HTTP service would read the same JSON object.
/// `what` names the argument in the message when it is not a dict.
pub fn body<T: DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    body_at(obj, what, "")
}

/// [`body`] for a dict found at `prefix` (e.g. `events[3]`), which starts every error path.
pub fn body_at<T: DeserializeOwned>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    prefix: &str,
) -> PyResult<T> {
    let Ok(dict) = obj.cast::<PyDict>() else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a dict, got {}",
            type_name(obj)
        )));
    };
    let mut value = convert_dict(dict, 0);
    if !prefix.is_empty() {
        value = value.map_err(|e| e.at(Segment::Key(prefix.to_string())));
    }
    from_json_at(value.map_err(ConvertError::into_pyerr)?, prefix)
}

/// Any JSON-like Python value as a typed value, as the HTTP service would read it at field
/// `what` (which starts every error path).
pub fn value_at<T: DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    let value = convert(obj, 0).map_err(|e| e.at(Segment::Key(what.to_string())).into_pyerr())?;
    from_json_at(value, what)
}

/// A request body with a `token_ids` field (the prompt routes).
pub trait TokenBody {
    fn set_token_ids(&mut self, tokens: Vec<u32>);
}

macro_rules! token_body {
    ($($t:ty),*) => {$(
        impl TokenBody for $t {
            fn set_token_ids(&mut self, tokens: Vec<u32>) {
                self.token_ids = Some(tokens);
            }
        }
    )*};
}
token_body!(SelectBody, ReservationBody, PromptRouteBody);

/// `token_ids` read straight into `u32`s when every item is a plain int in range; `None` sends
/// the request down the general path, which reports the exact error.
fn plain_tokens(list: &Bound<'_, PyList>) -> Option<Vec<u32>> {
    let mut tokens = Vec::with_capacity(list.len());
    for item in list.iter() {
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        tokens.push(item.extract::<u32>().ok()?);
    }
    Some(tokens)
}

/// How a buffer's items are read as token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemLayout {
    /// Raw bytes (`bytes`, `bytearray`, a byte memoryview): little-endian `u32`s, 4 bytes each.
    RawLittleEndianU32,
    /// Integers of `size` (4 or 8) bytes, each checked to lie in `0..=u32::MAX`.
    Int {
        size: usize,
        signed: bool,
        little_endian: bool,
    },
}

/// The layout of a buffer's items from its `struct` format string and item size; `None` for
/// anything that is not one of the accepted forms (floats, 2-byte integers, records, ...).
fn item_layout(format: &str, itemsize: usize) -> Option<ItemLayout> {
    let (order, code) = match format.as_bytes() {
        [code] => (b'@', *code),
        [order @ (b'@' | b'=' | b'<' | b'>' | b'!'), code] => (*order, *code),
        _ => return None,
    };
    let little_endian = match order {
        b'<' => true,
        b'>' | b'!' => false,
        _ => cfg!(target_endian = "little"),
    };
    match (code, itemsize) {
        (b'B' | b'c', 1) => Some(ItemLayout::RawLittleEndianU32),
        (b'I' | b'L' | b'Q' | b'N', 4 | 8) => Some(ItemLayout::Int {
            size: itemsize,
            signed: false,
            little_endian,
        }),
        (b'i' | b'l' | b'q' | b'n', 4 | 8) => Some(ItemLayout::Int {
            size: itemsize,
            signed: true,
            little_endian,
        }),
        _ => None,
    }
}

/// Token ids out of a buffer's bytes (C order), without a Python object per item. The error
/// names the first offending item as `token_ids[i]`.
fn tokens_from_bytes(bytes: &[u8], layout: ItemLayout) -> Result<Vec<u32>, String> {
    match layout {
        ItemLayout::RawLittleEndianU32 => {
            if !bytes.len().is_multiple_of(4) {
                return Err(format!(
                    "token_ids: {} bytes are not a whole number of little-endian u32 token ids \
                     (4 bytes each)",
                    bytes.len()
                ));
            }
            Ok(bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        // The common form (array('I'), numpy uint32 on this machine): the raw bytes' reading.
        ItemLayout::Int {
            size: 4,
            signed: false,
            little_endian: true,
        } => tokens_from_bytes(bytes, ItemLayout::RawLittleEndianU32),
        ItemLayout::Int {
            size,
            signed,
            little_endian,
        } => {
            let mut tokens = Vec::with_capacity(bytes.len() / size);
            for (i, chunk) in bytes.chunks_exact(size).enumerate() {
                let mut raw = [0u8; 8];
                // Widen to 8 bytes in little-endian order, sign-extending signed items.
                raw[..size].copy_from_slice(chunk);
                if !little_endian {
                    raw[..size].reverse();
                }
                if signed && raw[size - 1] & 0x80 != 0 {
                    raw[size..].fill(0xff);
                }
                let value = if signed {
                    i128::from(i64::from_le_bytes(raw))
                } else {
                    i128::from(u64::from_le_bytes(raw))
                };
                let token = u32::try_from(value).map_err(|_| {
                    format!(
                        "token_ids[{i}]: {value} is not a token id (0 to {})",
                        u32::MAX
                    )
                })?;
                tokens.push(token);
            }
            Ok(tokens)
        }
    }
}

/// `token_ids` given as any object with the buffer protocol (`array('I')`, a numpy array,
/// `bytes`, `memoryview`): `Ok(None)` when `value` has no buffer (the general path handles it),
/// an error naming `token_ids` for a buffer of a form not accepted.
///
/// The limited API of Python 3.9 (this wheel's abi3 floor) has no buffer calls, so the buffer is
/// read through a `memoryview`: its format and item size, then one copy of its bytes in C order
/// (`tobytes`), a memcpy, instead of one Python int per item.
fn buffer_tokens(value: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    // `bytes` is read in place: no memoryview, no copy.
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return tokens_from_bytes(bytes.as_bytes(), ItemLayout::RawLittleEndianU32)
            .map(Some)
            .map_err(PyValueError::new_err);
    }
    let Ok(view) = PyMemoryView::from(value) else {
        return Ok(None);
    };
    let py = value.py();
    let ndim: usize = view.getattr(pyo3::intern!(py, "ndim"))?.extract()?;
    let format: String = view.getattr(pyo3::intern!(py, "format"))?.extract()?;
    let itemsize: usize = view.getattr(pyo3::intern!(py, "itemsize"))?.extract()?;
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "token_ids: a buffer of token ids must be one-dimensional, got {ndim} dimensions"
        )));
    }
    let Some(layout) = item_layout(&format, itemsize) else {
        return Err(PyTypeError::new_err(format!(
            "token_ids: a buffer of format '{format}' ({itemsize}-byte items) is not accepted; \
             give 4- or 8-byte integers (array('I'), numpy uint32 or int64) or bytes of \
             little-endian u32"
        )));
    };
    let bytes = view.call_method0(pyo3::intern!(py, "tobytes"))?;
    let bytes = bytes.cast::<PyBytes>()?;
    tokens_from_bytes(bytes.as_bytes(), layout)
        .map(Some)
        .map_err(PyValueError::new_err)
}

/// [`body`] for a prompt route. A prompt is mostly `token_ids`; reading them directly instead of
/// through JSON values is several times faster and accepts and rejects exactly the same lists.
/// `token_ids` may also be a buffer ([`buffer_tokens`]), the fastest form.
pub fn prompt_body<T: DeserializeOwned + TokenBody>(
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<T> {
    let Ok(dict) = obj.cast::<PyDict>() else {
        return body(obj, what);
    };
    let key = pyo3::intern!(obj.py(), "token_ids");
    let tokens = match dict.get_item(key)? {
        Some(value) => match value.cast::<PyList>() {
            Ok(list) => plain_tokens(list),
            Err(_) => buffer_tokens(&value)?,
        },
        None => None,
    };
    let Some(tokens) = tokens else {
        return body(obj, what);
    };
    let rest = dict.copy()?;
    rest.del_item(key)?;
    let mut parsed: T = body(rest.as_any(), what)?;
    parsed.set_token_ids(tokens);
    Ok(parsed)
}

/// A JSON value as a typed value; a mismatch is a `ValueError` naming the field (the Python form
/// of the HTTP 422), its path starting with `prefix`.
fn from_json_at<T: DeserializeOwned>(value: Value, prefix: &str) -> PyResult<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        let path = match (prefix.is_empty(), path.is_empty() || path == ".") {
            (true, true) => String::new(),
            (true, false) => path,
            (false, true) => prefix.to_string(),
            (false, false) if path.starts_with('[') => format!("{prefix}{path}"),
            (false, false) => format!("{prefix}.{path}"),
        };
        if path.is_empty() {
            PyValueError::new_err(message)
        } else {
            PyValueError::new_err(format!("{path}: {message}"))
        }
    })
}

/// A JSON value as the Python value `json.loads` would give.
pub fn to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(v) = n.as_u64() {
                v.into_pyobject(py)?.into_any()
            } else if let Some(v) = n.as_i64() {
                v.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, to_py(py, v)?)?;
            }
            dict.into_any()
        }
    })
}
