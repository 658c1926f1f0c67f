// The OpenAI Node SDK's usual tool loop against detinfer serve: stream() -> finalChatCompletion(), run the call,
// send the SDK's own message back (with the parsed / parsed_arguments fields its helpers add). Prints one JSON line.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: "unused", maxRetries: 0 });
const params = { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"],
                 additionalProperties: false };
const tools = [{ type: "function", function: { name: "add", description: "Add two integers.", parameters: params, strict: true } }];
const shot = (q, a, b, id) => [
  { role: "user", content: q },
  { role: "assistant", content: null, tool_calls: [{ id, type: "function", function: { name: "add", arguments: JSON.stringify({ a, b }) } }] },
  { role: "tool", tool_call_id: id, content: String(a + b) },
  { role: "assistant", content: `${a}+${b} is ${a + b}.` }];
const messages = [...shot("What is 10+20?", 10, 20, "call_1"), ...shot("What is 7+8?", 7, 8, "call_2"),
                  { role: "user", content: "What is 2+3?" }];
const settings = { model: "smollm2", tools, temperature: 0, max_tokens: 64 };

const final = await client.chat.completions.stream({ ...settings, messages }).finalChatCompletion();
const message = final.choices[0].message;
messages.push(message);
for (const call of message.tool_calls ?? []) {
  const { a, b } = JSON.parse(call.function.arguments);
  messages.push({ role: "tool", tool_call_id: call.id, content: String(a + b) });
}
let follow;
try {
  const r = await client.chat.completions.create({ ...settings, messages });
  follow = { status: 200, content: r.choices[0].message.content };
} catch (e) {
  follow = { status: e.status ?? null, error: String(e.message) };
}
console.log(JSON.stringify({ finish_reason: final.choices[0].finish_reason, message, follow }));
