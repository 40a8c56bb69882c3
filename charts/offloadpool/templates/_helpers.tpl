{{- define "offloadpool.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "offloadpool.labels" -}}
app.kubernetes.io/part-of: offloadpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "offloadpool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "offloadpool.agentImage" -}}
{{ .Values.agent.image | default (include "offloadpool.image" .) }}
{{- end -}}

{{- define "offloadpool.operatorServiceAccount" -}}
{{ include "offloadpool.fullname" . }}-operator
{{- end -}}
