//! Tools in chat requests: the function definitions a client offers, the calls an assistant made earlier in the
//! conversation, and the client's `tool_choice`, read from OpenAI's chat-completions request shapes and serialized
//! in the form Hugging Face chat templates read them (transformers passes `tools` as a list of
//! `{"type": "function", "function": {"name", "description", "parameters"}}` objects and reads an assistant
//! message's `tool_calls[i].function.name` / `.arguments`, the arguments as a mapping).

use serde::Serialize;
use serde_json::{Map, Value};

/// A request's tool fields have a shape OpenAI's API does not allow.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolShapeError {
    /// `tools` is not a list.
    #[error("`tools` must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects")]
    ToolsNotList,
    /// `tools[index]` is malformed (the message says how).
    #[error("tools[{0}]: {1}")]
    Tool(usize, String),
    /// `tool_choice` is malformed.
    #[error("tool_choice: {0}")]
    Choice(String),
    /// `messages[index].tool_calls` is malformed.
    #[error("messages[{0}].tool_calls: {1}")]
    Call(usize, String),
}

impl ToolShapeError {
    /// The request field at fault, as OpenAI's error object names it (`param`).
    pub fn param(&self) -> &'static str {
        match self {
            ToolShapeError::ToolsNotList | ToolShapeError::Tool(..) => "tools",
            ToolShapeError::Choice(_) => "tool_choice",
            ToolShapeError::Call(..) => "messages",
        }
    }
}

/// A function the client offers the model; serializes as `{"type": "function", "function": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tool {
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function.
    pub function: FunctionDef,
}

/// A function's definition.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDef {
    /// Name (OpenAI's rule: 1 to 64 of `a-z A-Z 0-9 _ -`).
    pub name: String,
    /// What it does, for the model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its arguments as a JSON Schema object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// A call an assistant message made; serializes as `{"id"?, "type": "function", "function": {"name",
/// "arguments"}}` with the arguments as a JSON value (a mapping, as templates read them), not as a string.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// The call's id, when the client gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function called.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// Arguments (OpenAI sends them as a JSON string; they are kept parsed).
    pub arguments: Value,
}

/// Whether and how the model may call the offered tools (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// `"none"`: the tools are not offered.
    None,
    /// `"auto"` (the default): the model may answer or call.
    #[default]
    Auto,
    /// `"required"`: the model must call one of the tools.
    Required,
    /// `{"type": "function", "function": {"name": ...}}`: the model must call this function.
    Function(String),
}

/// Whether `name` follows OpenAI's rule for function names.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn name_of(f: &Map<String, Value>) -> Result<String, String> {
    match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => Ok(n.clone()),
        Some(Value::String(n)) => Err(format!("function name {n:?} is not 1-64 of a-z, A-Z, 0-9, _ and -")),
        _ => Err("`function.name` (a string) is required".into()),
    }
}

/// The `function` object of a tool, a call or a named tool choice, checking `type` is `"function"` when given.
fn function_of(v: &Value) -> Result<&Map<String, Value>, String> {
    let o = v.as_object().ok_or("must be an object")?;
    match o.get("type") {
        None => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(t) => return Err(format!("type {t} is not supported (only \"function\")")),
    }
    o.get("function").and_then(Value::as_object).ok_or_else(|| "`function` (an object) is required".into())
}

/// Reads OpenAI's `tools` (a list of `{"type": "function", "function": {"name", "description"?, "parameters"?}}`).
/// Errors: [`ToolShapeError::ToolsNotList`], [`ToolShapeError::Tool`] for a tool without a valid name, with a
/// description that is not a string or parameters that are not an object, or a name given twice.
pub fn tools_from_openai(v: &Value) -> Result<Vec<Tool>, ToolShapeError> {
    let list = v.as_array().ok_or(ToolShapeError::ToolsNotList)?;
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad = |m: String| ToolShapeError::Tool(i, m);
        let f = function_of(t).map_err(bad)?;
        let name = name_of(f).map_err(bad)?;
        if out.iter().any(|o| o.function.name == name) {
            return Err(bad(format!("function {name:?} is defined twice")));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => return Err(bad("`function.description` must be a string".into())),
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => None,
            Some(p @ Value::Object(_)) => Some(p.clone()),
            Some(_) => return Err(bad("`function.parameters` must be a JSON Schema object".into())),
        };
        out.push(Tool { kind: "function", function: FunctionDef { name, description, parameters } });
    }
    Ok(out)
}

/// Reads OpenAI's `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
/// Errors: [`ToolShapeError::Choice`] for anything else.
pub fn tool_choice_from_openai(v: &Value) -> Result<ToolChoice, ToolShapeError> {
    match v {
        Value::String(s) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            _ => Err(ToolShapeError::Choice(format!("{s:?} is not none, auto, required or a function"))),
        },
        _ => {
            let f = function_of(v).map_err(ToolShapeError::Choice)?;
            Ok(ToolChoice::Function(name_of(f).map_err(ToolShapeError::Choice)?))
        }
    }
}

/// Reads an assistant message's OpenAI `tool_calls` (message `index` of the request): a list of `{"id"?,
/// "type": "function", "function": {"name", "arguments"}}` whose arguments are a JSON string (or already an
/// object). Errors: [`ToolShapeError::Call`] for another shape or arguments that are not valid JSON.
pub fn tool_calls_from_openai(index: usize, v: &Value) -> Result<Vec<ToolCall>, ToolShapeError> {
    let bad = |m: String| ToolShapeError::Call(index, m);
    let list = v.as_array().ok_or_else(|| bad("must be a list".into()))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, c) in list.iter().enumerate() {
        let at = |m: String| bad(format!("[{k}]: {m}"));
        let f = function_of(c).map_err(at)?;
        let name = name_of(f).map_err(at)?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) => {
                serde_json::from_str(s).map_err(|e| at(format!("`function.arguments` is not valid JSON ({e})")))?
            }
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => return Err(at("`function.arguments` must be a JSON string".into())),
        };
        let id = match c.get("id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(at("`id` must be a string".into())),
        };
        out.push(ToolCall { id, kind: "function", function: FunctionCall { name, arguments } });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_read_and_serialize_in_the_templates_shape() {
        let v = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let tools = tools_from_openai(&v).unwrap();
        assert_eq!(tools[0].function.name, "get_weather");
        assert_eq!(serde_json::to_value(&tools).unwrap(), v);
        // no description, no parameters: the keys are left out (templates test `is defined`)
        let t = tools_from_openai(&json!([{"type": "function", "function": {"name": "f"}}])).unwrap();
        assert_eq!(serde_json::to_value(&t[0]).unwrap(), json!({"type": "function", "function": {"name": "f"}}));
    }

    #[test]
    fn bad_tool_shapes_name_the_field() {
        let cases = [
            json!({"type": "function"}),
            json!([{"type": "function", "function": {"description": "no name"}}]),
            json!([{"type": "retrieval", "function": {"name": "f"}}]),
            json!([{"type": "function", "function": {"name": "bad name!"}}]),
            json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            json!([{"function": {"name": "f"}}, {"function": {"name": "f"}}]),
        ];
        for c in cases {
            let e = tools_from_openai(&c).unwrap_err();
            assert_eq!(e.param(), "tools", "{c}");
        }
    }

    #[test]
    fn tool_choices() {
        assert_eq!(tool_choice_from_openai(&json!("none")).unwrap(), ToolChoice::None);
        assert_eq!(tool_choice_from_openai(&json!("required")).unwrap(), ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(tool_choice_from_openai(&named).unwrap(), ToolChoice::Function("f".into()));
        for bad in [json!("always"), json!(3), json!({"type": "function"})] {
            assert_eq!(tool_choice_from_openai(&bad).unwrap_err().param(), "tool_choice", "{bad}");
        }
    }

    #[test]
    fn history_calls_keep_arguments_parsed() {
        let v = json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
        let calls = tool_calls_from_openai(2, &v).unwrap();
        assert_eq!(calls[0].function.arguments, json!({"city": "Paris"}));
        assert_eq!(calls[0].id.as_deref(), Some("call_1"));
        let bad = json!([{"type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]);
        let e = tool_calls_from_openai(2, &bad).unwrap_err();
        assert_eq!(e.param(), "messages");
        assert!(
            e.to_string().starts_with("messages[2].tool_calls: [0]: `function.arguments` is not valid JSON"),
            "{e}"
        );
    }
}
